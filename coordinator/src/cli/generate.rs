//! `baton generate`: run a prompt through the whole model in this process, on the same step
//! loop and stage as `baton serve --workers 0`.

use std::io::Write;

use anyhow::{Context, Result, bail};
use baton_coordinator::api::output::Detokenizer;
use baton_coordinator::generation::{FinishReason, GenerationRequest, Generator, TokenEvent};
use baton_coordinator::local::{self, LocalStageOptions};
use baton_coordinator::pipeline::PipelineConfig;
use baton_coordinator::planner::SplitPolicy;
use baton_shared::model_files::ModelFiles;
use baton_shared::sampling::SamplingParams;
use baton_shared::settings::{PipelineSettings, SpeculativeSetting, WeightsSetting};
use baton_shared::tokenizer::Tokenizer;
use baton_worker::kv_cache::KvDtype;

use super::inspect::apply_chat_with;
use super::pipeline_args::names;
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
    /// Weight format: auto (q8_0, a Q8_0 file's blocks as stored: about 4x faster decode than
    /// f32), f32 (the reference numerics), bf16 / f16, q8_0, q4_0 / q4_1 (fewer bytes) or native
    /// (each tensor as the file stores it).
    #[arg(long, default_value = "auto", value_parser = names!(WeightsSetting))]
    pub weights: WeightsSetting,
    /// Threads for the matrix products (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where to compute: cpu (default), cpu:THREADS, or cuda:N (a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Speculative decoding: off, ngram (prompt lookup) or dflash (a draft model,
    /// --draft-model); output unchanged.
    #[arg(long, default_value = "off", value_parser = names!(SpeculativeSetting))]
    pub speculative: SpeculativeSetting,
    /// The DFlash draft checkpoint directory for --speculative dflash.
    #[arg(long)]
    pub draft_model: Option<String>,
    /// Proposals per verify step at most (1 to 16).
    #[arg(long, default_value_t = 4)]
    pub num_speculative_tokens: usize,
    /// Output: streamed text, or one JSON object at the end.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
}

pub fn run(ctx: &Ctx, a: GenerateArgs) -> Result<()> {
    let path = ctx.model_path(&a.model)?;
    // Token ids in and out need no tokenizer, so checkpoints without tokenizer files work too.
    let (files, tokenizer) = match super::open_model_at(&path) {
        Ok(m) => (m.files, Some(m.tokenizer)),
        Err(e) if a.prompt.is_none() && a.stop.is_empty() => {
            tracing::info!("no tokenizer ({e:#}); printing token ids");
            let files = ModelFiles::open(&path).with_context(|| format!("loading model {}", path.display()))?;
            (files, None)
        }
        Err(e) => return Err(e),
    };
    let config = files.config()?;
    let prompt = match (&a.prompt, &a.tokens, &tokenizer) {
        (Some(p), _, _) if p.is_empty() => bail!("empty prompt: pass some text with --prompt"),
        (Some(p), _, Some(tok)) if a.chat => tok.encode(&apply_chat_with(tok, p)?, false)?,
        (Some(p), _, Some(tok)) => tok.encode(p, true)?,
        (None, Some(t), _) => parse_token_list(t)?,
        (None, None, _) => bail!("pass --prompt TEXT or --tokens IDS"),
        (Some(_), _, None) => unreachable!("a prompt without a tokenizer failed above"),
    };
    let max_context = config.max_position_embeddings;
    if prompt.len() >= max_context {
        bail!(
            "the prompt has {} tokens; the model's context is {max_context}",
            prompt.len()
        );
    }
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        seed: a.seed,
        // Generation stops at the context's end ("length") rather than being refused.
        max_tokens: a.max_tokens.min(max_context - prompt.len()),
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        stop_token_ids: Vec::new(),
        speculative_tokens: None,
    };
    let speculative = super::pipeline_args::speculative(&PipelineSettings {
        speculative: a.speculative,
        num_speculative_tokens: a.num_speculative_tokens,
        draft_model: a.draft_model.clone(),
        ..PipelineSettings::default()
    })?;
    let block = 16;
    let eos_ids = tokenizer.as_ref().map(|t| t.eos_ids.clone()).unwrap_or_default();
    let pipeline = PipelineConfig {
        max_context,
        split: SplitPolicy::Even,
        weights: a.weights.as_str().to_string(),
        max_queue: 1,
        max_running: 1,
        // The whole prompt in one micro-batch, as a single sequence runs fastest (and room for
        // a decode step's proposals).
        max_batch_tokens: prompt.len().max(1 + speculative.tokens),
        speculative,
        kv_block_size: block,
        kv_max_blocks: Some((prompt.len() + params.max_tokens).div_ceil(block).max(1)),
        kv_dtype: KvDtype::F32,
        prefix_caching: false,
        state_snapshots: 0,
        ..PipelineConfig::new(path.display().to_string(), &config, eos_ids)
    };
    let device: baton_worker::backend::Device = a.device.parse()?;
    device.check_available()?;
    let opts = LocalStageOptions {
        device,
        format: super::pipeline_args::weight_format(a.weights.as_str(), &files)?,
        threads: a
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .max(1),
        check_finite: ctx.settings.check_weights,
        kv_budget_bytes: u64::MAX,
        kv_max_blocks: pipeline.kv_max_blocks,
        kv_block_size: block,
        kv_dtype: KvDtype::F32,
        draft_model: pipeline.speculative.worker_draft().map(std::path::PathBuf::from),
        state_slots: 1,
        state_snapshots: 0,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let stream = a.format == "text";
    let req = GenerationRequest {
        prompt: prompt.clone(),
        params,
        top_logprobs: 0,
        logprobs: false,
    };
    let (tokens, text, finish_reason) = runtime.block_on(async {
        let generator = local::start(pipeline, &path, &opts)?;
        generator.wait_ready(std::time::Duration::from_secs(60)).await?;
        let _span = tracing::info_span!("generate", prompt_tokens = prompt.len(), max_tokens = a.max_tokens).entered();
        let started = std::time::Instant::now();
        let out = print_events(&generator, req, tokenizer.as_ref(), &a.stop, stream).await;
        tracing::info!(secs = started.elapsed().as_secs_f64(), "generation finished");
        out
    })?;
    let mut stdout = std::io::stdout().lock();
    if stream {
        writeln!(stdout)?;
    } else {
        let out = serde_json::json!({
            "tokens": tokens,
            "text": text,
            "finish_reason": finish_reason.as_str(),
            "prompt_tokens": prompt.len(),
        });
        writeln!(stdout, "{out}")?;
    }
    Ok(())
}

/// Run `req` and read its events: the token ids, the text (with a tokenizer; streamed to
/// stdout when `stream`, else token ids are printed as they come) and why it ended.
async fn print_events(
    generator: &dyn Generator,
    req: GenerationRequest,
    tokenizer: Option<&Tokenizer>,
    stops: &[String],
    stream: bool,
) -> Result<(Vec<u32>, Option<String>, FinishReason)> {
    let mut rx = generator.submit(req).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut detok = tokenizer.map(|t| Detokenizer::new(t, stops));
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut stdout = std::io::stdout();
    let mut emit = |s: &str, text: &mut String| {
        text.push_str(s);
        if stream && !s.is_empty() {
            let _ = stdout.write_all(s.as_bytes());
            let _ = stdout.flush();
        }
    };
    let reason = loop {
        match rx.recv().await {
            Some(TokenEvent::PromptCached { .. }) => {}
            Some(TokenEvent::Token { id, .. }) => {
                tokens.push(id);
                match detok.as_mut() {
                    Some(d) => {
                        let step = d.token(id, None).map_err(|e| anyhow::anyhow!("{}", e.message))?;
                        emit(&step.text, &mut text);
                        if step.stopped {
                            break FinishReason::Stop;
                        }
                    }
                    None => emit(&format!("{}{id}", if tokens.len() > 1 { " " } else { "" }), &mut text),
                }
            }
            Some(TokenEvent::Done { reason }) => {
                let Some(d) = detok.as_mut() else { break reason };
                let (rest, stopped) = d.finish().map_err(|e| anyhow::anyhow!("{}", e.message))?;
                emit(&rest, &mut text);
                break if stopped { FinishReason::Stop } else { reason };
            }
            Some(TokenEvent::Failed { message, .. }) => bail!("generation failed: {message}"),
            None => bail!("the generator stopped without finishing"),
        }
    };
    Ok((tokens, detok.is_some().then_some(text), reason))
}
