//! `baton generate`: run a prompt through the whole model in this process.

use std::io::Write;

use anyhow::{Result, bail};
use baton_shared::sampling::SamplingParams;

use baton_worker::model::LoadOptions;

use super::inspect::{apply_chat, full_engine};
use super::{Ctx, ModelArg, parse_token_list};

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Prompt text.
    #[arg(long, conflicts_with = "tokens")]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long)]
    pub tokens: Option<String>,
    /// Wrap the prompt as a single user message in the model's chat template.
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling threshold (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens below min_p × the top probability (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Seed for reproducible sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop before this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Weight format: f32 (reference numerics), bf16 / f16, q8_0 (about 4x faster
    /// decode), q4_0 / q4_1 (fewer bytes) or native (each tensor as the file stores it).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16", "f16", "q8_0", "q4_0", "q4_1", "native"])]
    pub weights: String,
    /// Threads for the matrix products (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Output: streamed text, or one JSON object at the end.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
}

pub fn run(ctx: &Ctx, a: GenerateArgs) -> Result<()> {
    let model = ctx.open_model(&a.model)?;
    let prompt = match (&a.prompt, &a.tokens) {
        (Some(p), _) if p.is_empty() => bail!("empty prompt: pass some text with --prompt"),
        (Some(p), _) if a.chat => model.tokenizer.encode(&apply_chat(&model, p)?, false)?,
        (Some(p), _) => model.tokenizer.encode(p, true)?,
        (None, Some(t)) => parse_token_list(t)?,
        (None, None) => bail!("pass --prompt TEXT or --tokens IDS"),
    };
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        seed: a.seed,
        max_tokens: a.max_tokens,
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        stop_token_ids: Vec::new(),
    };
    let opts = LoadOptions {
        format: super::serve::weight_format(&a.weights)?,
        threads: a
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .max(1),
        kernels: None,
    };
    let mut engine = full_engine(ctx, &model.files, &model.config, &opts)?;
    let stream = a.format == "text";
    let mut stdout = std::io::stdout().lock();
    let span = tracing::info_span!("generate", prompt_tokens = prompt.len(), max_tokens = a.max_tokens).entered();
    let started = std::time::Instant::now();
    let generation = engine.generate(&prompt, &params, Some(&model.tokenizer), |text| {
        if stream {
            let _ = stdout.write_all(text.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    let secs = started.elapsed().as_secs_f64();
    drop(span);
    tracing::info!(tokens = generation.tokens.len(), secs, "generation finished");
    if stream {
        writeln!(stdout)?;
    } else {
        let out = serde_json::json!({
            "tokens": generation.tokens,
            "text": generation.text,
            "finish_reason": generation.finish_reason.as_str(),
            "prompt_tokens": prompt.len(),
        });
        writeln!(stdout, "{out}")?;
    }
    Ok(())
}
