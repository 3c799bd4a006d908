//! `baton coordinator`: the worker registry, the pipeline driver and the OpenAI API, for
//! workers started elsewhere (other machines, containers, pods).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result};
use baton_coordinator::api::{self, AppState};
use baton_coordinator::cluster;
use baton_coordinator::pipeline::PipelineConfig;
use baton_shared::wire::parse_dtype;

use super::serve::{default_served_name, shutdown_signal};
use super::{Ctx, ModelArg};

/// Flags of `baton coordinator`; each overrides `[coordinator]` in baton.toml and
/// `BATON_COORDINATOR__*` (defaults in `CoordinatorSettings`).
#[derive(Debug, clap::Args, serde::Serialize)]
pub struct CoordinatorArgs {
    #[command(flatten)]
    #[serde(skip)]
    pub model: ModelArg,
    /// gRPC address workers register at [default: 127.0.0.1:50051].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// HTTP address of the OpenAI-compatible API [default: 127.0.0.1:8000].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub http: Option<SocketAddr>,
    /// Pipeline stages (one worker each) [default: 2].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers: Option<usize>,
    /// Explicit layer cut points between stages, e.g. `10,20` for three stages.
    #[arg(long, value_delimiter = ',')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layer_cuts: Option<Vec<usize>>,
    /// Model name workers resolve themselves (default: the path this coordinator resolved).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_model: Option<String>,
    /// Shared cluster token (or BATON_CLUSTER_TOKEN / `cluster_token` in baton.toml).
    #[arg(long, hide_env_values = true)]
    #[serde(skip)]
    pub cluster_token: Option<String>,
    /// Wire type of hidden states between stages [default: f32].
    #[arg(long, value_parser = ["f32", "bf16", "f16"])]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_dtype: Option<String>,
    /// Weight format the stages hold: auto (the file's own quantization, else q8_0), f32 (the
    /// reference numerics), bf16 / f16, q8_0, q4_0 / q4_1 (fewer bytes) or native (each tensor
    /// as the file stores it) [default: auto].
    #[arg(long, value_parser = ["auto", "f32", "bf16", "f16", "q8_0", "q4_0", "q4_1", "native"])]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weights: Option<String>,
    /// Name clients pass as `model`.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_model_name: Option<String>,
    /// Requests allowed to wait; more are answered with HTTP 429 [default: 64].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_queue: Option<usize>,
    /// Sequences generated at once; more wait in the queue [default: 8].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_running: Option<usize>,
    /// Tokens per pipeline step; longer prompts are prefilled in chunks [default: 128].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batch_tokens: Option<usize>,
    /// Positions per paged-KV block [default: 16].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_block_size: Option<usize>,
    /// Cap on KV blocks per pipeline [default: what every worker's --kv-cache-mib fits].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_max_blocks: Option<usize>,
    /// How workers store keys and values: f32, or f16 for twice the tokens per KV budget [default: f32].
    #[arg(long, value_parser = ["f32", "f16"])]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_dtype: Option<String>,
    /// How layers are split among workers: measured (from each worker's timed layer and head)
    /// or even [default: measured].
    #[arg(long, value_parser = ["measured", "even"])]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
    /// Reuse cached K/V of full blocks a new prompt starts with: true or false [default: true].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_caching: Option<bool>,
    /// Largest accepted request body in bytes (HTTP 413 beyond) [default: 4194304].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_body_bytes: Option<usize>,
}

pub fn run(ctx: &Ctx, args: CoordinatorArgs) -> Result<()> {
    let a = ctx.settings.coordinator.clone();
    let token = args
        .cluster_token
        .clone()
        .or(ctx.settings.cluster_token.clone())
        .filter(|t| !t.is_empty())
        .context("a cluster token is required: pass --cluster-token, set BATON_CLUSTER_TOKEN, or put cluster_token in baton.toml")?;
    let path = ctx.model_path(&args.model)?;
    let model = super::open_model_at(&path)?;
    let dtype = parse_dtype(&a.activation_dtype)
        .with_context(|| format!("--activation-dtype '{}': expected f32, bf16 or f16", a.activation_dtype))?;
    super::serve::weight_format(&a.weights, &model.files)?;
    use super::serve::{kv_dtype, split_policy};
    let stages = if a.layer_cuts.is_empty() {
        a.workers
    } else {
        a.layer_cuts.len() + 1
    };
    anyhow::ensure!(
        (1..=model.config.num_layers).contains(&stages),
        "--workers {stages}: must be between 1 and the model's {} layers",
        model.config.num_layers
    );
    anyhow::ensure!(a.kv_block_size > 0, "kv_block_size must be at least 1");
    anyhow::ensure!(a.kv_max_blocks != Some(0), "kv_max_blocks must be at least 1");
    let config = PipelineConfig {
        model: a.worker_model.clone().unwrap_or_else(|| path.display().to_string()),
        num_layers: model.config.num_layers,
        vocab_size: model.config.vocab_size,
        max_context: model.config.max_position_embeddings,
        eos_ids: model.tokenizer.eos_ids.clone(),
        stages,
        cuts: (!a.layer_cuts.is_empty()).then(|| a.layer_cuts.clone()),
        cluster_token: token,
        activation_dtype: dtype,
        max_queue: a.max_queue,
        max_running: a.max_running,
        max_batch_tokens: a.max_batch_tokens.max(a.max_running),
        weights: a.weights.clone(),
        kv_dim: model.config.kv_dim(),
        kv_block_size: a.kv_block_size,
        kv_max_blocks: a.kv_max_blocks,
        kv_dtype: kv_dtype(&a.kv_dtype)?,
        split: split_policy(&a.split)?,
        prefix_caching: a.prefix_caching,
    };
    let name = a
        .served_model_name
        .clone()
        .unwrap_or_else(|| default_served_name(args.model.model.as_deref()));
    let max_context = model.config.max_position_embeddings;
    let sampling_defaults = model.files.sampling_defaults()?;
    tracing::info!(?sampling_defaults, "sampling defaults for fields a request leaves out");
    let tokenizer = Arc::new(model.tokenizer);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    baton_shared::telemetry::prometheus();
    runtime.block_on(async move {
        let registry = tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("binding {}", a.listen))?;
        let http = tokio::net::TcpListener::bind(a.http).await.with_context(|| format!("binding {}", a.http))?;
        let server = cluster::start(registry, config)?;
        let state = AppState {
            max_body_bytes: a.max_body_bytes,
            sampling_defaults,
            ..AppState::new(name.clone(), tokenizer, max_context, server.generator.clone())
        };
        println!(
            "Baton coordinator: workers register at {} ; API for {name} at http://{}/v1 (ready once {stages} worker(s) joined)",
            server.registry_addr,
            http.local_addr()?
        );
        api::serve(http, api::router(state), shutdown_signal()?).await?;
        Ok(())
    })
}
