//! `baton serve`: the OpenAI-compatible HTTP API over a token generator. The only difference
//! between modes is which `Generator` [`build_generator`] returns.

use std::future::Future;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use baton_coordinator::api::{self, AppState};
use baton_coordinator::cluster;
use baton_coordinator::generation::Generator;
use baton_coordinator::local::{self, LocalStageOptions};
use baton_coordinator::pipeline::PipelineConfig;
use baton_shared::fetch::{DEFAULT_MODEL, HF_REPO};
use baton_shared::model_source::LoadedModel;
use baton_shared::settings::ServeSettings;

use super::local_workers::{LocalWorkers, WorkerCommand};
use super::pipeline_args::{PipelineArgs, api_keys, http_limits, pipeline_config, weight_format};
use super::{Ctx, ModelArg};

/// Flags of `baton serve`; each overrides `[serve]` in baton.toml and `BATON_SERVE__*`
/// (defaults in `ServeSettings`).
#[derive(Debug, clap::Args, serde::Serialize)]
pub struct ServeArgs {
    #[command(flatten)]
    #[serde(skip)]
    pub model: ModelArg,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Port to listen on (0: any free port; the address is printed) [default: 8000].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Worker processes to split the model across; 0 runs the whole model in this process
    /// [default: 2].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers: Option<usize>,
    /// The pipeline's flags (shared with `baton coordinator`).
    #[command(flatten)]
    #[serde(flatten)]
    pub pipeline: PipelineArgs,
    /// Most tokens (prompt + completion) per request; default and upper bound: the model's
    /// context length.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<usize>,
    /// Devices of the local workers, one per worker in turn (e.g. `cuda:0,cuda:1` for a worker
    /// per GPU, `cuda:0,cpu` for a GPU stage and a CPU stage) [default: the CPU cores split
    /// among the workers].
    #[arg(long, value_delimiter = ',')]
    #[serde(skip)]
    pub device: Vec<String>,
}

/// How long in-flight requests may run on after Ctrl-C/SIGTERM before the process exits.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

pub fn run(ctx: &Ctx, args: ServeArgs) -> Result<()> {
    let a = &ctx.settings.serve;
    let name = a
        .pipeline
        .served_model_name
        .clone()
        .unwrap_or_else(|| default_served_name(args.model.model.as_deref()));
    // Bind before the slow model load so a taken port fails at once.
    let listener = std::net::TcpListener::bind((a.host.as_str(), a.port))
        .with_context(|| format!("listening on {}:{}", a.host, a.port))?;
    listener.set_nonblocking(true)?;

    let model_path = ctx.model_path(&args.model)?;
    let model = super::open_model_at(&model_path)?;
    let model_context = model.config.max_position_embeddings;
    let max_context = match a.max_model_len {
        Some(0) => bail!("--max-model-len must be at least 1"),
        Some(n) if n > model_context => {
            bail!("--max-model-len {n} exceeds the model's context length of {model_context}")
        }
        Some(n) => n,
        None => model_context,
    };
    if a.workers > model.config.num_layers {
        bail!(
            "--workers {}: the model has only {} layers to split",
            a.workers,
            model.config.num_layers
        );
    }
    let tokenizer = Arc::new(model.tokenizer.clone());
    let sampling_defaults = model.files.sampling_defaults()?;
    tracing::info!(?sampling_defaults, "sampling defaults for fields a request leaves out");

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("baton-http")
        .build()
        .context("starting the async runtime")?;
    baton_shared::telemetry::prometheus();
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let addr = listener.local_addr()?;
        let shutdown = shutdown_signal()?;
        // A bad key or key file fails before any worker starts.
        let api_keys = api_keys(&a.pipeline)?;
        let http_limits = http_limits(&a.pipeline)?;
        let (generator, mut workers) = build_generator(ctx, a, &args.device, &model_path, model, max_context).await?;
        let state = AppState {
            max_body_bytes: a.pipeline.max_body_bytes,
            body_timeout: std::time::Duration::from_secs(a.pipeline.body_timeout_secs),
            api_keys,
            sampling_defaults,
            ..AppState::new(name.clone(), tokenizer, max_context, generator.clone())
        };
        workers.wait_until_ready(generator.as_ref()).await?;
        // From here on a worker that exits is started again (and the pipeline rebuilt).
        let (workers_stop, workers_stopped) = tokio::sync::oneshot::channel::<()>();
        let supervisor = tokio::spawn(workers.supervise(async {
            let _ = workers_stopped.await;
        }));
        let stop_workers = || async {
            let _ = workers_stop.send(());
            let _ = supervisor.await;
        };
        println!("Baton serving {name} at http://{addr}/v1");
        std::io::stdout().flush()?;
        tracing::info!(%addr, model = %name, workers = a.workers, "serving");

        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let mut server = tokio::spawn(api::serve(listener, api::router(state), http_limits, async {
            let _ = stop_rx.await;
        }));
        let outcome = tokio::select! {
            () = shutdown => None,
            // The server only ends by itself on an error.
            result = &mut server => Some(result),
        };
        if let Some(result) = outcome {
            stop_workers().await;
            return Ok(result.context("HTTP server task")??);
        }
        tracing::info!("shutting down: finishing in-flight requests");
        let _ = stop_tx.send(());
        match tokio::time::timeout(SHUTDOWN_GRACE, server).await {
            Ok(result) => result.context("HTTP server task")??,
            Err(_) => tracing::warn!("in-flight requests did not finish within {SHUTDOWN_GRACE:?}; exiting"),
        }
        stop_workers().await;
        Ok::<(), anyhow::Error>(())
    })
}

/// The token generator for the chosen mode, and the worker processes it drives.
async fn build_generator(
    ctx: &Ctx,
    a: &ServeSettings,
    worker_devices: &[String],
    model_path: &Path,
    model: LoadedModel,
    max_context: usize,
) -> Result<(Arc<dyn Generator>, LocalWorkers)> {
    let p = &a.pipeline;
    let worker_model = std::fs::canonicalize(model_path)
        .unwrap_or_else(|_| model_path.to_path_buf())
        .display()
        .to_string();
    let config = pipeline_config(p, &model, worker_model, a.workers.max(1), max_context)?;
    if a.workers == 0 && worker_devices.len() > 1 {
        bail!(
            "with --workers 0 the whole model is one stage in this process: give one --device, not {worker_devices:?}"
        );
    }
    if a.workers == 0 {
        // The whole model on one stage in this process, through the same engine.
        let device: baton_worker::backend::Device = worker_devices.first().map_or("cpu", |d| d.as_str()).parse()?;
        device.check_available()?;
        let opts = LocalStageOptions {
            device,
            format: weight_format(p.weights.as_str(), &model.files)?,
            threads: cores(),
            check_finite: ctx.settings.check_weights,
            kv_budget_bytes: ctx.settings.worker.kv_cache_mib << 20,
            kv_max_blocks: p.kv_max_blocks,
            kv_block_size: p.kv_block_size,
            kv_dtype: config.kv_dtype,
            draft_model: config.speculative.worker_draft().map(std::path::PathBuf::from),
            state_slots: config.max_running,
            state_snapshots: config.state_snapshots,
        };
        let generator = tokio::task::block_in_place(|| local::start(config, model_path, &opts))?;
        return Ok((Arc::new(generator), LocalWorkers::none()));
    }
    // Pipeline mode: a registry on loopback and `a.workers` worker processes that join it with
    // a token made for this run. The plane never leaves loopback, so it is plain text (a TLS
    // identity from the settings is for `baton coordinator` / `baton worker`, and is cleared
    // for the local workers below).
    let token = baton_shared::auth::random_token();
    let registry = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the worker registry")?;
    let config = PipelineConfig {
        peer: baton_shared::auth::PeerAuth::plaintext(token.clone()),
        ..config
    };
    let server = cluster::start(registry, config, ctx.settings.grpc)?;
    let registry_url = format!("http://{}", server.registry_addr);
    // The workers share this machine: split its cores among them.
    let device = format!("cpu:{}", (cores() / a.workers).max(1));
    let exe = std::env::current_exe().context("locating the baton binary to start workers")?;
    let mut args: Vec<String> = ["worker", "--exit-with-stdin", "--listen", "127.0.0.1:0"]
        .map(String::from)
        .into();
    let devices = match worker_devices.is_empty() {
        true => vec![device],
        false => worker_devices.to_vec(),
    };
    for d in &devices {
        d.parse::<baton_worker::backend::Device>()?;
    }
    args.extend(["--coordinator".into(), registry_url]);
    let mut envs = vec![
        ("BATON_CLUSTER_TOKEN".to_string(), token),
        ("BATON_HOME".into(), ctx.settings.home().display().to_string()),
        ("BATON_LOG_LEVEL".into(), ctx.settings.log_level.clone()),
        ("BATON_CHECK_WEIGHTS".into(), ctx.settings.check_weights.to_string()),
        ("BATON_TLS_CERT".into(), String::new()),
        ("BATON_TLS_KEY".into(), String::new()),
        ("BATON_TLS_CA".into(), String::new()),
    ];
    if let Some(endpoint) = &ctx.settings.otlp_endpoint {
        envs.push(("BATON_OTLP_ENDPOINT".into(), endpoint.clone()));
    }
    let command = WorkerCommand {
        program: exe,
        args,
        envs,
        devices,
    };
    let workers = LocalWorkers::start(command, a.workers)?;
    Ok((server.generator, workers))
}

/// Cores of this machine (the thread budget split among local workers).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `smollm2-135m` for the default model, else the file stem or directory name.
pub(super) fn default_served_name(model: Option<&str>) -> String {
    match model {
        None => DEFAULT_MODEL.to_string(),
        Some(m) if m.eq_ignore_ascii_case(DEFAULT_MODEL) || m == HF_REPO => DEFAULT_MODEL.to_string(),
        Some(m) => {
            let p = Path::new(m);
            let name = if p.is_dir() { p.file_name() } else { p.file_stem() };
            name.map_or_else(|| m.to_string(), |n| n.to_string_lossy().into_owned())
        }
    }
}

/// Resolves on Ctrl-C, or SIGTERM where there is one. The handlers are installed when this is
/// called, so a signal sent right after the ready line is not missed.
pub(super) fn shutdown_signal() -> Result<impl Future<Output = ()> + Send + 'static> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    {
        let ctrl_c = tokio::signal::ctrl_c();
        Ok(async move {
            let _ = ctrl_c.await;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_names() {
        assert_eq!(default_served_name(None), "smollm2-135m");
        assert_eq!(default_served_name(Some("SmolLM2-135M")), "smollm2-135m");
        assert_eq!(default_served_name(Some("/m/Qwen3-0.6B.Q8_0.gguf")), "Qwen3-0.6B.Q8_0");
    }
}
