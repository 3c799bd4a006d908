//! `baton coordinator`: the worker registry, the pipeline driver and the OpenAI API, for
//! workers started elsewhere (other machines, containers, pods).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result};
use baton_coordinator::api::{self, AppState};
use baton_coordinator::cluster;
use baton_coordinator::pipeline::PipelineConfig;

use super::pipeline_args::{PipelineArgs, api_keys, http_limits, pipeline_config};
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
    /// Mutual TLS on the worker plane.
    #[command(flatten)]
    #[serde(skip)]
    pub tls: baton_worker::run::TlsArgs,
    /// The pipeline's flags (shared with `baton serve`).
    #[command(flatten)]
    #[serde(flatten)]
    pub pipeline: PipelineArgs,
}

pub fn run(ctx: &Ctx, args: CoordinatorArgs) -> Result<()> {
    let a = ctx.settings.coordinator.clone();
    let token = args
        .cluster_token
        .clone()
        .or(ctx.settings.cluster_token.clone())
        .filter(|t| !t.is_empty())
        .context("a cluster token is required: pass --cluster-token, set BATON_CLUSTER_TOKEN, or put cluster_token in baton.toml")?;
    // Checked before the model loads, so a misconfigured plane fails at once.
    let settings = args.tls.apply(ctx.settings.clone());
    let peer = settings.peer_auth(token)?;
    baton_shared::tls::check_listen(a.listen, peer.tls.is_some(), settings.allow_plaintext)?;
    let path = ctx.model_path(&args.model)?;
    let model = super::open_model_at(&path)?;
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
    let worker_model = a.worker_model.clone().unwrap_or_else(|| path.display().to_string());
    let max_context = model.config.max_position_embeddings;
    let config = PipelineConfig {
        cuts: (!a.layer_cuts.is_empty()).then(|| a.layer_cuts.clone()),
        peer,
        ..pipeline_config(&a.pipeline, &model, worker_model, stages, max_context)?
    };
    let name = a
        .pipeline
        .served_model_name
        .clone()
        .unwrap_or_else(|| default_served_name(args.model.model.as_deref()));
    let sampling_defaults = model.files.sampling_defaults()?;
    tracing::info!(?sampling_defaults, "sampling defaults for fields a request leaves out");
    let api_keys = api_keys(&a.pipeline)?;
    let http_limits = http_limits(&a.pipeline)?;
    let tokenizer = Arc::new(model.tokenizer);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    baton_shared::telemetry::prometheus();
    runtime.block_on(async move {
        let registry = tokio::net::TcpListener::bind(a.listen).await.with_context(|| format!("binding {}", a.listen))?;
        let http = tokio::net::TcpListener::bind(a.http).await.with_context(|| format!("binding {}", a.http))?;
        let tls = config.peer.tls.is_some();
        let server = cluster::start(registry, config, settings.grpc)?;
        let state = AppState {
            max_body_bytes: a.pipeline.max_body_bytes,
            body_timeout: std::time::Duration::from_secs(a.pipeline.body_timeout_secs),
            api_keys,
            sampling_defaults,
            ..AppState::new(name.clone(), tokenizer, max_context, server.generator.clone())
        };
        println!(
            "Baton coordinator: workers register at {}://{} ; API for {name} at http://{}/v1 (ready once {stages} worker(s) joined)",
            baton_shared::tls::scheme(tls),
            server.registry_addr,
            http.local_addr()?
        );
        api::serve(http, api::router(state), http_limits, shutdown_signal()?).await?;
        Ok(())
    })
}
