//! Subcommand definitions and dispatch; each subcommand lives in its own module.

mod bench;
mod certs;
mod convert;
mod coordinator;
mod generate;
mod inspect;
mod local_workers;
mod pipeline_args;
mod serve;
mod worker;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use baton_shared::model_source::{LoadedModel, resolve_model};
use baton_shared::settings::Settings;
use clap::{Parser, Subcommand};
use serde::Serialize;

/// Baton: pipeline-parallel LLM serving.
#[derive(Debug, Parser)]
#[command(name = "baton", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Flags every subcommand accepts; they override `baton.toml` and `BATON_*` variables.
#[derive(Debug, clap::Args, Serialize)]
pub struct GlobalArgs {
    /// Configuration file (default: ./baton.toml when present).
    #[arg(long, global = true, env = "BATON_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Cache directory for models (default: $BATON_HOME or ~/.cache/baton).
    #[arg(long, global = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub home: Option<PathBuf>,
    /// Log filter, e.g. `info` or `baton_worker=debug`.
    #[arg(long, global = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_level: Option<String>,
    /// Log format: text or json.
    #[arg(long, global = true, value_parser = ["text", "json"])]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_format: Option<String>,
    /// Export traces over OTLP/gRPC to this collector, e.g. http://localhost:4317.
    #[arg(long, global = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
}

/// The model to use: a .gguf file, a Hugging Face directory, or `smollm2-135m` (the default).
#[derive(Debug, clap::Args)]
pub struct ModelArg {
    /// Model: path to a .gguf file or Hugging Face directory, or a known name (smollm2-135m).
    /// Omitted: the default model, fetched on first use.
    #[arg(long, short)]
    pub model: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Download the default model (SmolLM2-135M-Instruct) into the cache and print its path.
    Fetch,
    /// Print token ids for a text as JSON.
    Tokenize(inspect::TokenizeArgs),
    /// Print fp32 logits for token ids as JSON.
    Logits(inspect::LogitsArgs),
    /// Generate text from a prompt on this machine (single process, fp32 reference path).
    Generate(generate::GenerateArgs),
    /// Convert a GGUF file into a Hugging Face directory (safetensors + config + tokenizer).
    Convert(convert::ConvertArgs),
    /// Serve the OpenAI-compatible API: a coordinator plus N local worker processes, each holding
    /// a contiguous range of layers (`--workers 0`: the whole model in this process).
    Serve(serve::ServeArgs),
    /// Run a coordinator (registry, pipeline driver, OpenAI API) for workers started elsewhere.
    Coordinator(coordinator::CoordinatorArgs),
    /// Run a pipeline worker that registers with a coordinator.
    Worker(baton_worker::run::WorkerArgs),
    /// Measure batch-1 decode or prefill speed on this machine per weight format and thread
    /// count, with the memory-bandwidth roofline for the same bytes.
    Bench(bench::BenchArgs),
    /// Make a development CA and a certificate per node for mutual TLS between coordinator and
    /// workers.
    Certs(certs::CertsArgs),
    /// Check a GPU against the CPU reference (kernels, model parity, batch invariance) and
    /// measure it (bandwidth, decode, prefill) into one JSON report; `--dry-run` on the CPU.
    DeviceCheck(baton_worker::device_check::CheckArgs),
}

/// Shared state for running a subcommand.
pub struct Ctx {
    pub settings: Settings,
}

impl Ctx {
    /// Resolve (and fetch if needed) the model path.
    pub fn model_path(&self, model: &ModelArg) -> Result<PathBuf> {
        let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
        Ok(resolve_model(
            model.model.as_deref(),
            &self.settings.home(),
            &self.settings.sources(),
            progress,
        )?)
    }

    /// Resolve and open the model.
    pub fn open_model(&self, model: &ModelArg) -> Result<LoadedModel> {
        let path = self.model_path(model)?;
        open_model_at(&path)
    }
}

/// Open a model, with the path in the error context.
pub fn open_model_at(path: &Path) -> Result<LoadedModel> {
    let _span = tracing::info_span!("model.open", path = %path.display()).entered();
    LoadedModel::open(path).with_context(|| format!("loading model {}", path.display()))
}

/// Load settings and run the chosen subcommand.
pub fn run(cli: Cli) -> Result<()> {
    // Command flags override their section of the settings ([serve], [coordinator], [worker]).
    let mut flags = serde_json::to_value(&cli.global)?;
    let section = match &cli.command {
        Command::Serve(a) => Some(("serve", serde_json::to_value(a)?)),
        Command::Coordinator(a) => Some(("coordinator", serde_json::to_value(a)?)),
        Command::Worker(a) => Some(("worker", serde_json::to_value(a)?)),
        _ => None,
    };
    if let (Some((name, value)), Some(map)) = (section, flags.as_object_mut()) {
        map.insert(name.to_string(), value);
    }
    let settings = Settings::load(cli.global.config.as_deref(), flags)?;
    let service = match &cli.command {
        Command::Worker(_) => "baton-worker",
        _ => "baton-coordinator",
    };
    let _logging = baton_shared::logging::init(&settings.logging(service))?;
    let ctx = Ctx { settings };
    match cli.command {
        Command::Fetch => {
            let path = ctx.model_path(&ModelArg { model: None })?;
            println!("{}", path.display());
            Ok(())
        }
        Command::Tokenize(a) => inspect::tokenize(&ctx, a),
        Command::Logits(a) => inspect::logits(&ctx, a),
        Command::Generate(a) => generate::run(&ctx, a),
        Command::Convert(a) => convert::run(&ctx, a),
        Command::Serve(a) => serve::run(&ctx, a),
        Command::Coordinator(a) => coordinator::run(&ctx, a),
        Command::Worker(a) => worker::run(&ctx, a),
        Command::Bench(a) => bench::run(&ctx, a),
        Command::Certs(a) => certs::run(a),
        Command::DeviceCheck(a) => baton_worker::device_check::run(&a).map(|_| ()),
    }
}

/// Parse "1,2,3" into token ids.
pub fn parse_token_list(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(|x| x.trim())
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<u32>().with_context(|| {
                format!("'{x}' is not a token id (expected a comma-separated list of non-negative integers)")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    anyhow::ensure!(!ids.is_empty(), "empty token list: pass at least one token id");
    Ok(ids)
}
