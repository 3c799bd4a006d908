//! The worker's gRPC service: load a stage, run micro-batches and pass their hidden states
//! straight to the next stage, relay sampled tokens back, free sequences, report health.

use std::path::Path;
use std::sync::{Arc, Mutex};

use baton_shared::auth::{AddToken, PeerAuth};
use baton_shared::fetch::Sources;
use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::ModelFiles;
use baton_shared::model_source::resolve_model;
use baton_shared::proto::worker_client::WorkerClient;
use baton_shared::proto::worker_server::Worker;
use baton_shared::proto::{
    ActivateStageRequest, BatchResult, CostPoint, Dtype, FreeRequest, FreeResponse, HealthRequest, HealthResponse,
    LayerClassCost, LoadStageRequest, LoadStageResponse, MicroBatch, ProfileRequest, ProfileResponse, TrimRequest,
    TrimResponse,
};
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::backend::{self, BackendOptions, Device};
use crate::kv_cache::{KvDtype, UnknownKvDtype};
use crate::model::WeightFormat;
use crate::profiler::{self, ProfileError, ProfileSpec};
use crate::stage::{Stage, StageOutput};

/// Client for a worker, with the cluster token attached.
pub type AuthedWorkerClient = WorkerClient<InterceptedService<Channel, AddToken>>;

/// Connect to a worker at `url` with this node's credentials (token, and TLS when on).
pub async fn connect_worker(url: &str, peer: &PeerAuth) -> Result<AuthedWorkerClient, Status> {
    let channel = peer
        .endpoint(url)?
        .connect_timeout(std::time::Duration::from_secs(5))
        // Pings find a peer that vanished without closing (a frozen VM, a dropped route) on
        // long-lived streams, where no request would time out.
        .http2_keep_alive_interval(std::time::Duration::from_secs(10))
        .keep_alive_timeout(std::time::Duration::from_secs(20))
        .keep_alive_while_idle(true)
        .connect()
        .await
        .map_err(|e| Status::unavailable(format!("cannot connect to {url}: {e}")))?;
    Ok(WorkerClient::with_interceptor(channel, peer.add_token()?).max_decoding_message_size(MAX_MESSAGE))
}

/// Largest gRPC message a client accepts or sends (hidden states of a large prefill chunk); a
/// server's own limit is `[grpc] max_message_mib`.
pub const MAX_MESSAGE: usize = baton_shared::grpc_limits::DEFAULT_MAX_MESSAGE_MIB << 20;

/// Everything a worker process knows.
pub struct WorkerState {
    pub worker_id: Mutex<String>,
    stage: Arc<Mutex<Option<Stage>>>,
    /// Stages loaded so far, bumped under the stage lock: a forward stream serves only the
    /// stage that was current when it opened, so a stream of an older pipeline (from a
    /// coordinator that moved on while this worker was frozen) cannot touch the new one.
    loads: Arc<std::sync::atomic::AtomicU64>,
    /// A stage loaded beside the served one (and its next stage's URL), until ActivateStage.
    staged: Mutex<Option<(Stage, String)>>,
    next_stage: Mutex<String>,
    peer: PeerAuth,
    home: std::path::PathBuf,
    sources: Sources,
    check_weights: bool,
    /// Where stages run.
    device: Device,
    /// Threads for a stage's matrix products.
    threads: usize,
    /// Most bytes a stage's KV pool may take.
    kv_cache_bytes: u64,
}

impl WorkerState {
    /// State for a worker that resolves models under `home` and calls its next stage as `peer`.
    pub fn new(
        peer: PeerAuth,
        home: std::path::PathBuf,
        sources: Sources,
        check_weights: bool,
        device: Device,
        threads: usize,
        kv_cache_bytes: u64,
    ) -> Self {
        Self {
            worker_id: Mutex::new(String::new()),
            stage: Arc::new(Mutex::new(None)),
            loads: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            staged: Mutex::new(None),
            next_stage: Mutex::new(String::new()),
            peer,
            home,
            sources,
            check_weights,
            device,
            threads: threads.max(1),
            kv_cache_bytes,
        }
    }

    /// Resolve and open `model` (empty: the default) and parse the weight format `weights`
    /// (empty: f32), as LoadStage and Profile name them.
    fn open_model(&self, model: &str, weights: &str) -> Result<(ModelFiles, ModelConfig, WeightFormat), Status> {
        let model = (!model.is_empty()).then_some(model);
        let path = resolve_model(model, &self.home, &self.sources, false)
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        let files = ModelFiles::open(&path).map_err(|e| Status::failed_precondition(e.to_string()))?;
        let cfg = files.config().map_err(|e| Status::failed_precondition(e.to_string()))?;
        let format = if weights.is_empty() {
            Ok(WeightFormat::F32)
        } else {
            crate::model::resolve_format(weights, &files)
        }
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok((files, cfg, format))
    }

    /// Backend options on this worker's device for weights in `format` (the KV geometry is the
    /// caller's to fill in).
    /// Whether this host has the memory to load a stage with a KV pool of `pool_bytes` beside
    /// the one it serves: its weights are estimated at 1.5 times the served stage's (a re-plan
    /// moves a few layers), and the host's available memory must hold both.
    /// On a GPU, the memory in question is the GPU's free memory.
    fn room_beside_current(&self, pool_bytes: u128) -> Result<(), Status> {
        let (served, device_free) = lock(&self.stage).as_ref().map_or((0, None), |s| {
            (s.backend().info().weight_bytes as u128, s.backend().device_free_bytes())
        });
        let need = pool_bytes + served * 3 / 2;
        let (available, what) = match device_free {
            Some(free) => (free, "this GPU has"),
            None => (
                crate::run::meminfo("MemAvailable:").ok_or_else(|| {
                    Status::resource_exhausted(
                        "this host's available memory is unknown: not loading a stage beside the served one",
                    )
                })?,
                "this host has",
            ),
        };
        if need > available as u128 {
            return Err(Status::resource_exhausted(format!(
                "a stage beside the served one needs about {need} bytes; {what} {available} available"
            )));
        }
        Ok(())
    }

    fn backend_options(&self, format: WeightFormat) -> BackendOptions {
        BackendOptions {
            device: self.device,
            format,
            cpu: crate::backend::CpuOptions::threads(self.threads),
            check_finite: self.check_weights,
            kv_blocks: 0,
            kv_block_size: 0,
            kv_dtype: KvDtype::F32,
            state_slots: 0,
            state_snapshots: 0,
        }
    }
}

/// A request's KV dtype ("" is f32), refused by name when unknown.
fn parse_kv_dtype(s: &str) -> Result<KvDtype, Status> {
    if s.is_empty() {
        return Ok(KvDtype::F32);
    }
    s.parse()
        .map_err(|e: UnknownKvDtype| Status::invalid_argument(e.to_string()))
}

/// The gRPC service.
#[derive(Clone)]
pub struct WorkerService {
    pub state: Arc<WorkerState>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock is a bug; keep serving rather than poisoning everything.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl WorkerService {
    /// Serve `stage` from now on (forwarding to `next`): streams opened before close.
    fn install(&self, stage: Stage, next: String) {
        let info = stage.info();
        tracing::info!(layers = ?(info.layer_start..info.layer_end), first = info.first, last = info.last, next = %next, "stage loaded");
        // Per-stage counters start at 0, so dashboards see them before the first error.
        let label = [("stage", stage.stage_index.to_string())];
        metrics::counter!("baton_stage_errors_total", &label).increment(0);
        if !info.last {
            metrics::counter!("baton_transfer_bytes_total", &label).increment(0);
        }
        let b = stage.backend().info();
        let kv = stage.backend().kv();
        metrics::gauge!("baton_stage_backend_info",
            "stage" => stage.stage_index.to_string(), "device" => b.device.kind(), "kernels" => b.kernels,
            "threads" => b.threads.to_string(), "weights" => b.weights.to_string(), "kv_dtype" => kv.dtype.to_string())
        .set(1.0);
        metrics::gauge!("baton_worker_kv_bytes").set(kv.bytes as f64);
        // A stage prepared beside the old one is not kept past a load that replaces both.
        lock(&self.state.staged).take();
        let mut slot = lock(&self.state.stage);
        *slot = Some(stage);
        self.state.loads.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        *lock(&self.state.next_stage) = next;
    }

    /// Run `f` on the stage. The stage is locked for a whole micro-batch, so waiting for it
    /// happens off the runtime's worker threads: a Free arriving mid-batch must not stall the
    /// tasks queued behind it (heartbeats among them, or the coordinator declares us dead).
    fn with_stage<R>(&self, f: impl FnOnce(Option<&mut Stage>) -> R) -> R {
        tokio::task::block_in_place(|| f(lock(&self.state.stage).as_mut()))
    }
}

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn load_stage(&self, req: Request<LoadStageRequest>) -> Result<Response<LoadStageResponse>, Status> {
        let metadata = req.metadata().clone();
        let r = req.into_inner();
        let r_staged = r.staged;
        let state = self.state.clone();
        let span = tracing::info_span!("stage.load", stage = r.stage_index, layers = ?(r.layer_start..r.layer_end));
        baton_shared::trace_context::set_parent_from_metadata(&span, &metadata);
        let stage = tokio::task::spawn_blocking(move || {
            let _g = span.entered();
            let (files, cfg, format) = state.open_model(&r.model, &r.weights)?;
            let (start, end) = (r.layer_start as usize, r.layer_end as usize);
            if start >= end || end > cfg.num_layers {
                return Err(Status::invalid_argument(format!(
                    "layer range {start}..{end} is not a non-empty range inside 0..{}",
                    cfg.num_layers
                )));
            }
            let opts = BackendOptions {
                kv_blocks: r.kv_blocks as usize,
                kv_block_size: r.kv_block_size as usize,
                kv_dtype: parse_kv_dtype(&r.kv_dtype)?,
                state_snapshots: r.state_snapshots as usize,
                state_slots: r.state_slots as usize,
                ..state.backend_options(format)
            };
            let pool_bytes = opts.kv_bytes(&cfg, start..end);
            if r.staged {
                state.room_beside_current(pool_bytes)?;
            }
            if pool_bytes > state.kv_cache_bytes as u128 {
                return Err(Status::resource_exhausted(format!(
                    "{} KV blocks of {} positions for layers {start}..{end} take {pool_bytes} bytes, \
                     more than this worker's KV budget of {} bytes (kv_cache_mib)",
                    opts.kv_blocks, opts.kv_block_size, state.kv_cache_bytes
                )));
            }
            let backend = backend::load(&files, &cfg, start..end, &opts).map_err(|e| match e {
                backend::BackendError::KvGeometry { .. } => Status::invalid_argument(e.to_string()),
                _ => Status::failed_precondition(e.to_string()),
            })?;
            let info = backend.info();
            tracing::info!(device = %info.device, kernels = %info.kernels, threads = info.threads,
                weights = %info.weights, weight_bytes = info.weight_bytes, kv_dtype = %opts.kv_dtype,
                "stage backend loaded");
            let mut backend = backend;
            let runner = match r.draft_model.is_empty() {
                true => None,
                false => Some(
                    crate::drafting::attach(&mut *backend, Path::new(&r.draft_model), &files, opts.cpu.threads, None)
                        .map_err(|e| Status::failed_precondition(e.to_string()))?,
                ),
            };
            let dtype = Dtype::try_from(r.activation_dtype).unwrap_or(Dtype::F32);
            let mut stage = Stage::new(backend, r.stage_index, dtype);
            if let Some(runner) = runner {
                stage.serve_draft(runner);
            }
            Ok((stage, r.next_stage))
        })
        .await
        .map_err(|e| Status::internal(format!("stage load task failed: {e}")))??;
        let (stage, next) = stage;
        let info = stage.info();
        if !info.last && next.is_empty() {
            return Err(Status::invalid_argument("a stage that is not last needs next_stage"));
        }
        if r_staged {
            tracing::info!(layers = ?(info.layer_start..info.layer_end), "stage loaded beside the served one");
            *lock(&self.state.staged) = Some((stage, next));
            return Ok(Response::new(LoadStageResponse { stage: Some(info) }));
        }
        self.install(stage, next);
        Ok(Response::new(LoadStageResponse { stage: Some(info) }))
    }

    async fn activate_stage(&self, _req: Request<ActivateStageRequest>) -> Result<Response<LoadStageResponse>, Status> {
        let (stage, next) = lock(&self.state.staged)
            .take()
            .ok_or_else(|| Status::failed_precondition("no staged stage to activate: send a staged LoadStage first"))?;
        let info = stage.info();
        self.install(stage, next);
        Ok(Response::new(LoadStageResponse { stage: Some(info) }))
    }

    type ForwardStream = ReceiverStream<Result<BatchResult, Status>>;

    async fn forward(&self, req: Request<Streaming<MicroBatch>>) -> Result<Response<Self::ForwardStream>, Status> {
        let mut inbound = req.into_inner();
        let (up_tx, up_rx) = mpsc::channel::<Result<BatchResult, Status>>(64);
        let stage = self.state.stage.clone();
        let loads = self.state.loads.clone();
        let opened = loads.load(std::sync::atomic::Ordering::Acquire);
        let next_url = lock(&self.state.next_stage).clone();
        let peer = self.state.peer.clone();
        let worker_id = lock(&self.state.worker_id).clone();
        tokio::spawn(async move {
            let mut down: Option<mpsc::Sender<MicroBatch>> = None;
            while let Some(msg) = inbound.next().await {
                let batch = match msg {
                    Ok(b) => b,
                    Err(e) if e.code() == tonic::Code::OutOfRange => {
                        // Over grpc.max_message_mib: the upstream gets the error (and the
                        // server's limit metric counts it) instead of a stream that just ends.
                        tracing::warn!(error = %e, "a micro-batch over the message size limit ended the forward stream");
                        let _ = up_tx.send(Err(e)).await;
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "upstream closed the forward stream");
                        break;
                    }
                };
                let batch_id = batch.batch_id;
                let span = crate::stage::forward_span(&worker_id, &batch);
                // Compute on this runtime thread (tokio moves its other tasks away) rather than
                // handing the batch to a blocking-pool thread: one thread switch less per hop.
                let out = tokio::task::block_in_place(|| {
                    let mut slot = lock(&stage);
                    if loads.load(std::sync::atomic::Ordering::Acquire) != opened {
                        return None;
                    }
                    Some(match slot.as_mut() {
                        Some(stage) => stage.run_observed(batch, &span),
                        None => Err("no stage loaded on this worker".to_string()),
                    })
                });
                let Some(out) = out else {
                    tracing::warn!(
                        batch_id,
                        "a new stage was loaded since this forward stream opened: closing the stale stream"
                    );
                    break;
                };
                let sent = match out {
                    Ok(StageOutput::Sampled(result)) => up_tx.send(Ok(result)).await.is_ok(),
                    Err(error) => up_tx
                        .send(Ok(BatchResult {
                            batch_id,
                            results: vec![],
                            error,
                        }))
                        .await
                        .is_ok(),
                    Ok(StageOutput::Forward(mut mb)) => {
                        if down.is_none() {
                            match open_downstream(&next_url, &peer, up_tx.clone()).await {
                                Ok(tx) => down = Some(tx),
                                Err(e) => {
                                    let _ = up_tx.send(Err(e)).await;
                                    break;
                                }
                            }
                        }
                        let bytes = mb.hidden.as_ref().map_or(0, |t| t.data.len());
                        let transfer = tracing::info_span!(parent: &span, "stage.transfer", bytes);
                        mb.trace_context = baton_shared::trace_context::inject(&transfer);
                        mb.sent_unix_nanos = baton_shared::wire::unix_nanos();
                        match down.as_ref() {
                            Some(tx) => tx.send(mb).instrument(transfer).await.is_ok(),
                            None => false,
                        }
                    }
                };
                if !sent {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(up_rx)))
    }

    async fn free(&self, req: Request<FreeRequest>) -> Result<Response<FreeResponse>, Status> {
        let ids = req.into_inner().seq_ids;
        let freed = self.with_stage(|stage| {
            stage.map_or(0, |s| {
                let n = s.free(&ids);
                s.record_usage();
                n
            })
        });
        Ok(Response::new(FreeResponse { freed: freed as u32 }))
    }

    async fn trim(&self, req: Request<TrimRequest>) -> Result<Response<TrimResponse>, Status> {
        let r = req.into_inner();
        self.with_stage(|stage| {
            let stage = stage.ok_or_else(|| Status::failed_precondition("no stage loaded on this worker"))?;
            let length = stage
                .trim(r.seq_id, r.length as usize)
                .ok_or_else(|| Status::not_found(format!("sequence {} is not on this worker", r.seq_id)))?;
            stage.record_usage();
            Ok(Response::new(TrimResponse { length: length as u32 }))
        })
    }

    async fn health(&self, _req: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        let worker_id = lock(&self.state.worker_id).clone();
        let mut health = self.with_stage(|stage| stage.map_or_else(HealthResponse::default, |s| s.health()));
        health.worker_id = worker_id;
        Ok(Response::new(health))
    }

    async fn profile(&self, req: Request<ProfileRequest>) -> Result<Response<ProfileResponse>, Status> {
        let metadata = req.metadata().clone();
        let r = req.into_inner();
        let state = self.state.clone();
        let span = tracing::info_span!("stage.profile", model = %r.model, weights = %r.weights,
            token_counts = ?r.token_counts, context = r.context);
        baton_shared::trace_context::set_parent_from_metadata(&span, &metadata);
        let started = std::time::Instant::now();
        let profile = tokio::task::spawn_blocking(move || {
            let _g = span.entered();
            let (files, cfg, format) = state.open_model(&r.model, &r.weights)?;
            let spec = ProfileSpec {
                token_counts: r.token_counts.iter().map(|&t| t as usize).collect(),
                context: r.context as usize,
                reps: if r.reps == 0 { 3 } else { r.reps as usize },
                min_seconds: f64::from(r.min_millis) / 1e3,
            };
            let opts = BackendOptions {
                kv_dtype: parse_kv_dtype(&r.kv_dtype)?,
                ..state.backend_options(format)
            };
            profiler::profile(&files, &cfg, &opts, &spec, state.kv_cache_bytes).map_err(|e| match e {
                ProfileError::TokenCounts(_)
                | ProfileError::Context(_)
                | ProfileError::MinSeconds(_)
                | ProfileError::Reps(_)
                | ProfileError::Logits { .. } => Status::invalid_argument(e.to_string()),
                ProfileError::KvBudget { .. } => Status::resource_exhausted(e.to_string()),
                _ => Status::failed_precondition(e.to_string()),
            })
        })
        .await
        .map_err(|e| Status::internal(format!("profile task failed: {e}")))??;
        metrics::histogram!("baton_worker_profile_seconds").record(started.elapsed().as_secs_f64());
        let points = |v: &[profiler::CostPoint]| {
            v.iter()
                .map(|p| CostPoint {
                    tokens: p.tokens as u32,
                    seconds: p.seconds,
                })
                .collect()
        };
        tracing::info!(kernels = %profile.kernels, threads = profile.threads,
            layer = ?profile.layer, head = ?profile.head, classes = ?profile.classes, "profiled");
        Ok(Response::new(ProfileResponse {
            layer: points(&profile.layer),
            head: points(&profile.head),
            embed: points(&profile.embed),
            layer_weight_bytes: profile.bytes.layers as u64,
            embed_weight_bytes: profile.bytes.embedding as u64,
            head_weight_bytes: profile.bytes.head as u64,
            classes: profile
                .classes
                .iter()
                .map(|c| LayerClassCost {
                    class: c.class.name().to_string(),
                    layer: points(&c.layer),
                    weight_bytes: c.bytes as u64,
                })
                .collect(),
            kernels: profile.kernels,
            threads: profile.threads as u32,
        }))
    }
}

/// Open the Forward stream to the next stage; its results are relayed into `up_tx`.
async fn open_downstream(
    url: &str,
    peer: &PeerAuth,
    up_tx: mpsc::Sender<Result<BatchResult, Status>>,
) -> Result<mpsc::Sender<MicroBatch>, Status> {
    let mut client = connect_worker(url, peer).await?;
    client = client.max_encoding_message_size(MAX_MESSAGE);
    let (tx, rx) = mpsc::channel::<MicroBatch>(64);
    let mut responses = client
        .forward(ReceiverStream::new(rx))
        .await
        .map_err(|e| Status::unavailable(format!("next stage {url}: {}", e.message())))?
        .into_inner();
    let url = url.to_string();
    tokio::spawn(async move {
        loop {
            match responses.next().await {
                Some(Ok(r)) => {
                    if up_tx.send(Ok(r)).await.is_err() {
                        break;
                    }
                }
                Some(Err(e)) => {
                    let _ = up_tx
                        .send(Err(Status::unavailable(format!("next stage {url}: {}", e.message()))))
                        .await;
                    break;
                }
                None => break,
            }
        }
    });
    Ok(tx)
}
