//! `baton worker` / `baton-worker`: start the gRPC server and join the cluster.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result};
use baton_shared::proto::worker_server::WorkerServer;
use baton_shared::settings::Settings;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;

use crate::backend::Device;
use crate::registration::{self, WorkerDescription};
use crate::service::{MAX_MESSAGE, WorkerService, WorkerState};

/// Command-line flags of a worker; each overrides `[worker]` in baton.toml and
/// `BATON_WORKER__*` (defaults in `WorkerSettings`).
#[derive(Debug, Clone, clap::Args, serde::Serialize)]
pub struct WorkerArgs {
    /// Address to listen on for gRPC (port 0: any free port) [default: 127.0.0.1:0].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// Address other processes reach this worker at (default: the bound listen address).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise: Option<String>,
    /// Coordinator registry URL, e.g. http://coordinator:50051 (DNS names are retried until they resolve).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coordinator: Option<String>,
    /// Device: `cpu` (all cores) or `cpu:N` (N threads for the matrix products) [default: cpu];
    /// `cuda[:GPU]` (GPU number, default 0) in a build with the `cuda` feature, which needs only the NVIDIA driver.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Shared cluster token (or BATON_CLUSTER_TOKEN / `cluster_token` in baton.toml).
    #[arg(long, hide_env_values = true)]
    #[serde(skip)]
    pub cluster_token: Option<String>,
    /// Stable worker id (default: assigned by the coordinator).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<SocketAddr>,
    /// MiB for the paged KV pool [default: 1024].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache_mib: Option<u64>,
    /// Mutual TLS on the worker plane.
    #[command(flatten)]
    #[serde(skip)]
    pub tls: TlsArgs,
    /// Exit when standard input closes: `baton serve` holds the other end, so its workers end
    /// with it even when it is killed outright.
    #[arg(long, hide = true)]
    #[serde(skip)]
    pub exit_with_stdin: bool,
}

/// Worker-plane TLS flags, shared by `baton worker` and `baton coordinator`; each overrides the
/// top-level `tls_cert`, `tls_key`, `tls_ca` and `allow_plaintext` settings (`BATON_TLS_*`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// This node's certificate chain (PEM), e.g. from `baton certs`.
    #[arg(long)]
    pub tls_cert: Option<std::path::PathBuf>,
    /// This node's private key (PEM).
    #[arg(long)]
    pub tls_key: Option<std::path::PathBuf>,
    /// The cluster CA certificate (PEM); peers must present certificates it signed.
    #[arg(long)]
    pub tls_ca: Option<std::path::PathBuf>,
    /// Allow a plain-text worker plane on a non-loopback address (a network you trust).
    #[arg(long)]
    pub allow_plaintext: bool,
}

impl TlsArgs {
    /// `settings` with these flags applied over them.
    pub fn apply(&self, mut settings: Settings) -> Settings {
        if self.tls_cert.is_some() {
            settings.tls_cert = self.tls_cert.clone();
        }
        if self.tls_key.is_some() {
            settings.tls_key = self.tls_key.clone();
        }
        if self.tls_ca.is_some() {
            settings.tls_ca = self.tls_ca.clone();
        }
        settings.allow_plaintext |= self.allow_plaintext;
        settings
    }
}

/// A GPU worker's memory (the GPU's) and what it registers about its GPU: name, compute
/// capability, multiprocessors.
#[cfg(feature = "cuda")]
fn gpu_description(gpu: u32) -> anyhow::Result<(u64, Vec<String>)> {
    let i = crate::ops::cuda::device::describe(gpu)?;
    tracing::info!(gpu, name = %i.name, sm = i.sm, multiprocessors = i.multiprocessors, memory = i.total_bytes, "GPU");
    Ok((
        i.total_bytes as u64,
        vec![
            format!("kernels:cuda_sm{}", i.sm),
            format!("gpu:{}", i.name),
            format!("compute_capability:{}.{}", i.sm / 10, i.sm % 10),
            format!("multiprocessors:{}", i.multiprocessors),
        ],
    ))
}

#[cfg(not(feature = "cuda"))]
fn gpu_description(gpu: u32) -> anyhow::Result<(u64, Vec<String>)> {
    Err(crate::backend::BackendError::Unavailable(Device::Cuda { gpu }).into())
}

fn total_memory() -> u64 {
    meminfo("MemTotal:").unwrap_or(0)
}

/// A `/proc/meminfo` field in bytes (Linux only; None elsewhere or when unreadable).
pub(crate) fn meminfo(field: &str) -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = m
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()?;
    Some(kb * 1024)
}

/// Run a worker until the process is stopped.
pub async fn run(args: WorkerArgs, settings: Settings) -> Result<()> {
    let settings = args.tls.apply(settings);
    let w = &settings.worker;
    let coordinator = w.coordinator.clone().filter(|c| !c.is_empty()).context(
        "the coordinator's registry URL is required: pass --coordinator, set BATON_WORKER__COORDINATOR, \
         or put coordinator under [worker] in baton.toml",
    )?;
    let token = args.cluster_token.clone().or(settings.cluster_token.clone()).filter(|t| !t.is_empty()).context(
        "a cluster token is required: pass --cluster-token, set BATON_CLUSTER_TOKEN, or put cluster_token in baton.toml \
         (the same on coordinator and workers)",
    )?;
    let peer = settings.peer_auth(token)?;
    baton_shared::tls::check_listen(w.listen, peer.tls.is_some(), settings.allow_plaintext)?;
    let device: Device = w.device.parse()?;
    device.check_available()?;
    let listener = tokio::net::TcpListener::bind(w.listen)
        .await
        .with_context(|| format!("binding {}", w.listen))?;
    let bound = listener.local_addr()?;
    let address = w
        .advertise
        .clone()
        .unwrap_or_else(|| format!("{}://{bound}", peer.scheme()));
    // Checked here so a mismatch is one clear start-up error, not a coordinator that cannot
    // reach the worker (or a worker that cannot register).
    baton_shared::tls::check_scheme(&address, peer.tls.is_some()).context("--advertise")?;
    baton_shared::tls::check_scheme(&coordinator, peer.tls.is_some()).context("--coordinator")?;
    let cores = match device {
        Device::Cpu { threads: Some(n) } => n as u32,
        _ => std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
    };
    let kernels = crate::kernels::cpu::dispatch::Kernels::detect();
    let state = Arc::new(WorkerState::new(
        peer.clone(),
        settings.home(),
        settings.sources(),
        settings.check_weights,
        device,
        cores as usize,
        w.kv_cache_mib << 20,
    ));
    let service = WorkerService { state: state.clone() };
    let server = InterceptedService::new(
        WorkerServer::new(service)
            .max_decoding_message_size(settings.grpc.max_message_bytes())
            .max_encoding_message_size(MAX_MESSAGE),
        peer.check_token(),
    );
    baton_shared::telemetry::prometheus();
    metrics::gauge!("baton_kernel_info", "path" => kernels.path().name()).set(1.0);
    // Bound before registering, so the address the coordinator shows is the one that serves
    // (port 0 picks a free port: tests and several workers on one host need no port plan).
    let metrics_address = match w.metrics_listen {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding metrics on {addr}"))?;
            let bound = listener.local_addr()?;
            tracing::info!(addr = %bound, "metrics at /metrics");
            let app = axum::Router::new().route(
                "/metrics",
                axum::routing::get(|| async { baton_shared::telemetry::render() }),
            );
            tokio::spawn(async move { axum::serve(listener, app).await });
            bound.to_string()
        }
        None => String::new(),
    };
    let (memory_bytes, mut features) = match device {
        Device::Cuda { gpu } => gpu_description(gpu)?,
        Device::Cpu { .. } => (total_memory(), vec![format!("kernels:{}", kernels.path().name())]),
    };
    // Every device takes every weight format and K/V type.
    features.extend([
        "weights:f32,bf16,f16,q8_0,q4_0,q4_1,native".into(),
        "kv_dtype:f32,f16".into(),
    ]);
    let desc = WorkerDescription {
        worker_id: w.worker_id.clone(),
        address: address.clone(),
        device_kind: device.kind().into(),
        cores,
        memory_bytes,
        kv_cache_bytes: w.kv_cache_mib << 20,
        metrics_address,
        features,
    };
    if args.exit_with_stdin {
        std::thread::spawn(|| {
            let mut sink = [0u8; 64];
            while matches!(std::io::Read::read(&mut std::io::stdin(), &mut sink), Ok(n) if n > 0) {}
            tracing::info!("parent process gone (stdin closed); exiting");
            std::process::exit(0);
        });
    }
    tracing::info!(%address, coordinator = %coordinator, tls = peer.tls.is_some(), "worker listening");
    let membership = tokio::spawn(registration::run(
        coordinator.clone(),
        peer.clone(),
        desc,
        state.clone(),
    ));
    settings
        .grpc
        .apply(peer.server()?)
        .add_service(server)
        // Small messages (sampled ids) must not wait for Nagle's algorithm.
        .serve_with_incoming_shutdown(TcpIncoming::from(listener).with_nodelay(Some(true)), shutdown_signal())
        .await
        .context("worker gRPC server")?;
    membership.abort();
    let id = state.worker_id.lock().unwrap_or_else(|e| e.into_inner()).clone();
    registration::deregister(&coordinator, &peer, &id).await;
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
