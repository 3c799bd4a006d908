//! `baton coordinator`: the worker registry, the pipeline driver and the OpenAI API, for
//! workers started elsewhere (other machines, containers, pods).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result};
use baton_coordinator::api::{self, AppState, DEFAULT_MAX_BODY_BYTES};
use baton_coordinator::cluster;
use baton_coordinator::pipeline::PipelineConfig;
use baton_shared::wire::parse_dtype;

use super::serve::{default_served_name, shutdown_signal};
use super::{Ctx, ModelArg};

#[derive(Debug, clap::Args)]
pub struct CoordinatorArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// gRPC address workers register at.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// HTTP address of the OpenAI-compatible API.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub http: SocketAddr,
    /// Pipeline stages (one worker each); the model's layers are split evenly.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Explicit layer cut points between stages, e.g. `10,20` for three stages.
    #[arg(long, value_delimiter = ',')]
    pub layer_cuts: Vec<usize>,
    /// Model name workers resolve themselves (default: the path this coordinator resolved).
    #[arg(long)]
    pub worker_model: Option<String>,
    /// Shared cluster token (or BATON_CLUSTER_TOKEN / `cluster_token` in baton.toml).
    #[arg(long, env = "BATON_CLUSTER_TOKEN", hide_env_values = true)]
    pub cluster_token: Option<String>,
    /// Wire type of hidden states between stages: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub activation_dtype: String,
    /// Name clients pass as `model`.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Requests allowed to wait; more are answered with HTTP 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Largest accepted request body in bytes (HTTP 413 beyond).
    #[arg(long, default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
}

pub fn run(ctx: &Ctx, a: CoordinatorArgs) -> Result<()> {
    let token = a
        .cluster_token
        .clone()
        .or(ctx.settings.cluster_token.clone())
        .filter(|t| !t.is_empty())
        .context("a cluster token is required: pass --cluster-token, set BATON_CLUSTER_TOKEN, or put cluster_token in baton.toml")?;
    let path = ctx.model_path(&a.model)?;
    let model = super::open_model_at(&path)?;
    let dtype = parse_dtype(&a.activation_dtype)
        .with_context(|| format!("--activation-dtype '{}': expected f32, bf16 or f16", a.activation_dtype))?;
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
    };
    let name = a
        .served_model_name
        .clone()
        .unwrap_or_else(|| default_served_name(a.model.model.as_deref()));
    let max_context = model.config.max_position_embeddings;
    let tokenizer = Arc::new(model.tokenizer);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let registry = tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("binding {}", a.listen))?;
        let http = tokio::net::TcpListener::bind(a.http).await.with_context(|| format!("binding {}", a.http))?;
        let server = cluster::start(registry, config)?;
        let state = AppState {
            max_body_bytes: a.max_body_bytes,
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
