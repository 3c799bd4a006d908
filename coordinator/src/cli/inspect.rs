//! `baton tokenize` and `baton logits`: look inside the tokenizer and the fp32 forward pass.

use anyhow::{Context, Result};
use baton_shared::chat_template::{ChatMessage, ChatTemplate};
use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::ModelFiles;
use baton_shared::model_source::LoadedModel;
use baton_shared::tokenizer::Tokenizer;
use baton_worker::engine::Engine;
use baton_worker::model::{LoadOptions, StageWeights};

use super::{Ctx, ModelArg, parse_token_list};

#[derive(Debug, clap::Args)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Text to tokenize.
    #[arg(long)]
    pub text: String,
    /// Wrap the text as a single user message in the model's chat template first.
    #[arg(long)]
    pub chat: bool,
}

#[derive(Debug, clap::Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Comma-separated token ids.
    #[arg(long)]
    pub tokens: String,
    /// Positions to print: every position or only the last.
    #[arg(long, default_value = "last", value_parser = ["all", "last"])]
    pub positions: String,
}

/// The text a user message becomes under the model's chat template.
pub fn apply_chat(model: &LoadedModel, user: &str) -> Result<String> {
    apply_chat_with(&model.tokenizer, user)
}

/// [`apply_chat`] with the tokenizer (which holds the template) alone.
pub fn apply_chat_with(tok: &Tokenizer, user: &str) -> Result<String> {
    let src = tok
        .chat_template
        .as_deref()
        .context("the model has no chat template; drop --chat")?;
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
    let tmpl = ChatTemplate::new(src, &name(tok.bos_id), &name(tok.eos_ids.first().copied()))?;
    Ok(tmpl.render(
        &[ChatMessage {
            role: "user".into(),
            content: user.into(),
        }],
        true,
    )?)
}

pub fn tokenize(ctx: &Ctx, a: TokenizeArgs) -> Result<()> {
    let model = ctx.open_model(&a.model)?;
    let ids = if a.chat {
        model.tokenizer.encode(&apply_chat(&model, &a.text)?, false)?
    } else {
        model.tokenizer.encode(&a.text, true)?
    };
    println!("{}", serde_json::json!({ "ids": ids }));
    Ok(())
}

/// Load the whole model as one stage (`opts` picks the weight format and threads).
pub fn full_engine(ctx: &Ctx, files: &ModelFiles, config: &ModelConfig, opts: &LoadOptions) -> Result<Engine> {
    let _span = tracing::info_span!(
        "model.load_weights",
        weights = opts.format.name(),
        threads = opts.threads
    )
    .entered();
    let weights = StageWeights::load_full_with(files, config, ctx.settings.check_weights, opts)?;
    Ok(Engine::new(weights))
}

pub fn logits(ctx: &Ctx, a: LogitsArgs) -> Result<()> {
    let tokens = parse_token_list(&a.tokens)?;
    // Logits need no tokenizer, so models without one (e.g. test checkpoints) work too.
    let path = ctx.model_path(&a.model)?;
    let files = ModelFiles::open(&path).with_context(|| format!("loading model {}", path.display()))?;
    let config = files.config()?;
    // The fp32 reference numerics: this is the command parity is checked with.
    let mut engine = full_engine(ctx, &files, &config, &LoadOptions::default())?;
    let out = engine.prompt_logits(&tokens, a.positions == "all")?;
    let rows: Vec<&[f32]> = out.chunks(config.vocab_size).collect();
    let mut stdout = std::io::stdout().lock();
    serde_json::to_writer(&mut stdout, &serde_json::json!({ "logits": rows }))?;
    use std::io::Write;
    writeln!(stdout)?;
    Ok(())
}
