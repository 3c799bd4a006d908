//! Builds the pipeline from registered workers (layer ranges from `split`, LoadStage on each, a
//! Forward stream into stage 0), runs the engine on it, and starts over when a stage fails or
//! leaves. [`run_local`] does the same for the one in-process stage of `--workers 0`.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use baton_shared::proto::{ActivateStageRequest, LoadStageRequest};
use baton_worker::service::{AuthedWorkerClient, MAX_MESSAGE, connect_worker};
use baton_worker::stage::Stage;
use tokio::sync::mpsc;

use super::replan::{self, DriftWatch, PlanInputs, Staged, Staging};
use super::sizing::{self, StageCosts, StepLimits};
use super::split::{self, ProfileCache, SplitInfo};
use super::stage_stats;
use super::{NewSequence, PipelineConfig, PipelineStatus};
use crate::engine::{self, EngineEnd};
use crate::executor::StageFailure;
use crate::executor::grpc::GrpcExecutor;
use crate::executor::local::{LOCAL_WORKER, LocalExecutor};
use crate::generation::TokenEvent;
use crate::planner::even_split;
use crate::registry::{Cluster, WorkerEntry};

/// Which worker serves which layers.
#[derive(Debug, Clone, PartialEq)]
pub struct StageAssignment {
    pub worker_id: String,
    pub address: String,
    pub layers: Range<usize>,
}

/// A built pipeline: clients for every stage, in order, the KV blocks every stage holds and
/// the step limits it runs with.
pub(crate) struct Pipeline {
    pub stages: Vec<(StageAssignment, AuthedWorkerClient)>,
    pub kv_blocks: usize,
    pub limits: StepLimits,
}

/// The most KV blocks every stage's pool fits in its worker's budget (and the configured cap),
/// after the recurrent-state slots and snapshots a stage with linear-attention layers keeps.
pub(super) fn kv_blocks(
    config: &PipelineConfig,
    workers: &[WorkerEntry],
    ranges: &[Range<usize>],
) -> Result<usize, BuildError> {
    let mut blocks = config.kv_max_blocks.unwrap_or(usize::MAX);
    for (i, (w, layers)) in workers.iter().zip(ranges).enumerate() {
        let bytes = config.cache_bytes(layers.clone());
        let states = match bytes.per_state {
            0 => 0,
            _ => config.state_copies(),
        };
        let state_bytes = bytes.total(0, states);
        let left = (w.kv_cache_bytes as u128).saturating_sub(state_bytes);
        // A stage of linear-attention layers only stores no K/V: any block count fits.
        let fits = match bytes.per_block {
            0 if state_bytes <= w.kv_cache_bytes as u128 => usize::MAX,
            0 => 0,
            per_block => (left / per_block as u128).min(usize::MAX as u128) as usize,
        };
        if fits == 0 {
            let message = format!(
                "worker {} ({}) has a KV budget of {} bytes, less than one block of {} positions for layers {:?} ({} bytes) \
                 beside {states} recurrent-state copies ({state_bytes} bytes: a slot per running sequence and the prefix \
                 cache's snapshots): raise its kv_cache_mib, or lower max_running or state_snapshots",
                w.id, w.address, w.kv_cache_bytes, config.kv_block_size, layers, bytes.per_block
            );
            return Err(BuildError {
                message,
                worker: Some(i),
            });
        }
        blocks = blocks.min(fits);
    }
    if blocks == usize::MAX {
        // No stage stores K/V: enough blocks for every running sequence's whole context.
        blocks = config.state_copies().max(1) * config.max_context.div_ceil(config.kv_block_size.max(1));
    }
    Ok(blocks)
}

/// Why a build failed, and the worker (index into the build's workers) that failed it, when
/// one did.
#[derive(Debug)]
pub(super) struct BuildError {
    pub message: String,
    pub worker: Option<usize>,
}

impl From<String> for BuildError {
    fn from(message: String) -> Self {
        Self { message, worker: None }
    }
}

async fn build(
    config: &PipelineConfig,
    workers: &[WorkerEntry],
    profiles: &mut ProfileCache,
) -> Result<(Pipeline, SplitInfo), BuildError> {
    let mut clients = Vec::with_capacity(workers.len());
    for (i, w) in workers.iter().enumerate() {
        let client = connect_worker(&w.address, &config.peer).await.map_err(|e| BuildError {
            message: format!("stage {i} ({}): {}", w.address, e.message()),
            worker: Some(i),
        })?;
        clients.push(client.max_encoding_message_size(MAX_MESSAGE));
    }
    let (config, limits) = size_limits(config, workers, &clients, profiles).await;
    let config = &config;
    // The split planner sizes its shapes from the sized limits (a prompt chunk from the token
    // budget, the decode step it reports from the running limit); the running limit is then
    // brought within the pool the chosen ranges really have (below).
    let (mut ranges, mut split) = split::choose(config, workers, &clients, profiles).await?;
    let kv_blocks = match kv_blocks(config, workers, &ranges) {
        Ok(b) => b,
        // The plan weighs weights, not KV: a stage it loads up may leave no room for a block.
        Err(e) if split.policy == "measured" => {
            tracing::warn!("the measured split leaves no KV room ({}); splitting evenly", e.message);
            ranges = even_split(config.num_layers, config.stages);
            split = SplitInfo::unmeasured("even", Some(e.message));
            kv_blocks(config, workers, &ranges)?
        }
        Err(e) => return Err(e),
    };
    let limits = limits.within_pool(config.auto_limits, kv_blocks * config.kv_block_size, config.max_context);
    let stages: Vec<_> = workers
        .iter()
        .zip(ranges)
        .zip(clients)
        .map(|((w, layers), client)| {
            let a = StageAssignment {
                worker_id: w.id.clone(),
                address: w.address.clone(),
                layers,
            };
            (a, client)
        })
        .collect();
    // Load every stage (they load in parallel: SmolLM2 takes seconds per stage).
    load_stages(config, &stages, kv_blocks, false).await?;
    Ok((
        Pipeline {
            stages,
            kv_blocks,
            limits,
        },
        split,
    ))
}

/// `config` with the limits it leaves open sized (`sizing`) from the workers' profiles (taken
/// now if not cached; the split planner reuses them) for an even split over `workers`, and the
/// KV pool that split would have (unbounded when it would have none: the planned split may
/// fit where the even one does not, and the built pool bounds the limit in the end). A worker
/// that cannot be profiled leaves them unmeasured.
async fn size_limits(
    config: &PipelineConfig,
    workers: &[WorkerEntry],
    clients: &[AuthedWorkerClient],
    profiles: &mut ProfileCache,
) -> (PipelineConfig, StepLimits) {
    let even = even_split(config.num_layers, workers.len());
    let kv_positions = kv_blocks(config, workers, &even).map_or(usize::MAX, |b| b * config.kv_block_size);
    let measured = match config.auto_limits.any() {
        true => split::profiles(config, workers, clients, profiles)
            .await
            .inspect_err(|e| tracing::warn!("step limits stay unmeasured: {e}"))
            .ok(),
        false => None,
    };
    let table = config.planned_layers();
    let costs = measured.as_ref().map(|w| StageCosts {
        workers: w,
        ranges: &even,
        layers: &table,
    });
    let limits = sizing::size(
        config.auto_limits,
        config.max_running,
        config.max_batch_tokens,
        workers.len(),
        costs.as_ref(),
        kv_positions,
        config.max_context,
    )
    .within_state(config.auto_limits, state_bound(config, workers, &even));
    (with_limits(config, &limits), limits)
}

/// The most sequences whose recurrent-state slot fits in every stage's KV budget beside the
/// prefix cache's snapshots and the K/V blocks a sequence is planned to hold
/// ([`sizing::PLANNED_POSITIONS`], the model's context if shorter); None when no stage of
/// `ranges` keeps recurrent state.
pub(super) fn state_bound(config: &PipelineConfig, workers: &[WorkerEntry], ranges: &[Range<usize>]) -> Option<usize> {
    let mut bound: Option<usize> = None;
    for (w, layers) in workers.iter().zip(ranges) {
        let bytes = config.cache_bytes(layers.clone());
        if bytes.per_state == 0 {
            continue;
        }
        let fits = sizing::state_sequences(
            bytes,
            w.kv_cache_bytes,
            config.state_snapshots,
            config.kv_block_size,
            config.max_context,
        );
        bound = Some(bound.map_or(fits, |b| b.min(fits)));
    }
    bound
}

/// `config` running with `limits`.
fn with_limits(config: &PipelineConfig, limits: &StepLimits) -> PipelineConfig {
    PipelineConfig {
        max_running: limits.max_running,
        max_batch_tokens: limits.max_batch_tokens,
        ..config.clone()
    }
}

/// Publish the limits a pipeline runs with (`/admin/cluster`, gauges, a log line).
fn publish_limits(limits: &StepLimits, status: &PipelineStatus) {
    tracing::info!(
        max_running = limits.max_running,
        running_bound = limits.running_bound,
        max_batch_tokens = limits.max_batch_tokens,
        tokens_bound = limits.tokens_bound,
        "step limits"
    );
    metrics::gauge!("baton_max_running_sequences").set(limits.max_running as f64);
    metrics::gauge!("baton_max_batch_tokens").set(limits.max_batch_tokens as f64);
    *status.limits.lock().unwrap_or_else(|e| e.into_inner()) = Some(limits.clone());
}

/// LoadStage on every stage's worker at once: stage `i` holds its assignment's layers and
/// forwards to stage `i + 1`; `staged` loads each beside the stage it serves.
pub(super) async fn load_stages(
    config: &PipelineConfig,
    stages: &[(StageAssignment, AuthedWorkerClient)],
    kv_blocks: usize,
    staged: bool,
) -> Result<(), BuildError> {
    let loads = stages.iter().enumerate().map(|(i, (a, client))| {
        let mut client = client.clone();
        let next = stages.get(i + 1).map(|(n, _)| n.address.clone()).unwrap_or_default();
        let req = LoadStageRequest {
            model: config.model.clone(),
            layer_start: a.layers.start as u32,
            layer_end: a.layers.end as u32,
            weights: config.weights.clone(),
            kv_blocks: kv_blocks as u64,
            kv_block_size: config.kv_block_size as u32,
            kv_dtype: config.kv_dtype.to_string(),
            activation_dtype: config.activation_dtype as i32,
            next_stage: next,
            stage_index: i as u32,
            staged,
            draft_model: config.speculative.worker_draft().unwrap_or_default().to_string(),
            // One recurrent-state slot per sequence that may run (a stage without
            // linear-attention layers keeps none).
            state_slots: config.max_running.min(u32::MAX as usize) as u32,
            state_snapshots: config.state_snapshots.min(u32::MAX as usize) as u32,
        };
        let label = format!("stage {i} ({}, layers {:?})", a.address, a.layers);
        async move {
            client.load_stage(req).await.map_err(|e| BuildError {
                message: format!("{label}: {}", e.message()),
                worker: Some(i),
            })
        }
    });
    for r in futures::future::join_all(loads).await {
        r?;
    }
    Ok(())
}

/// Fail every waiting submission while the pipeline is down.
fn reject_waiting(submit_rx: &mut mpsc::Receiver<NewSequence>, why: &str) {
    while let Ok(s) = submit_rx.try_recv() {
        let _ = s.tx.try_send(TokenEvent::Failed {
            message: why.to_string(),
            retriable: true,
        });
    }
}

/// Requests waiting while a pipeline that stood is rebuilt: sequences moved from it (first,
/// in their order), then new submissions. They wait up to the queue timeout.
struct Recovery {
    /// When the pipeline broke.
    since: std::time::Instant,
    /// Why, for the error of requests that waited too long.
    reason: String,
}

impl Recovery {
    /// Take new submissions into `backlog` (up to the queue limit; beyond it they stay in the
    /// channel, whose fullness answers 429), drop requests whose client left, and fail those
    /// that waited longer than the queue timeout. New submissions are refused (503) once
    /// recovery itself has taken longer than the queue timeout.
    fn hold(
        &self,
        config: &PipelineConfig,
        backlog: &mut VecDeque<NewSequence>,
        submit_rx: &mut mpsc::Receiver<NewSequence>,
        status: &PipelineStatus,
    ) {
        while backlog.len() < config.max_queue {
            let Ok(s) = submit_rx.try_recv() else { break };
            backlog.push_back(s);
        }
        backlog.retain(|s| {
            if s.tx.is_closed() {
                return false;
            }
            if s.request.queued_at.elapsed() <= config.queue_timeout {
                return true;
            }
            metrics::counter!("baton_http_limit_hits_total", "limit" => "queue_timeout").increment(1);
            let _ = s.tx.try_send(TokenEvent::Failed {
                message: format!(
                    "the pipeline broke ({}) and was not rebuilt within the queue timeout of {:?}; retry later",
                    self.reason, config.queue_timeout
                ),
                retriable: true,
            });
            false
        });
        let accepting = self.since.elapsed() <= config.queue_timeout;
        status.recovering.store(accepting, Ordering::Release);
        metrics::gauge!("baton_queue_depth").set((submit_rx.len() + backlog.len()) as f64);
    }
}

/// While no pipeline serves: hold requests when one stood before (`recovery`), else refuse
/// them with `why`.
fn wait_without_pipeline(
    recovery: &Option<Recovery>,
    config: &PipelineConfig,
    backlog: &mut VecDeque<NewSequence>,
    submit_rx: &mut mpsc::Receiver<NewSequence>,
    status: &PipelineStatus,
    why: &str,
) {
    match recovery {
        Some(r) => r.hold(config, backlog, submit_rx, status),
        None => reject_waiting(submit_rx, why),
    }
}

/// A pipeline ended (broke, or was replaced): count it, and hold requests from now on,
/// timed from the first break since a pipeline last served (a rebuild that fails to open
/// keeps that clock).
fn pipeline_ended(failure: &StageFailure, recovery: &mut Option<Recovery>, status: &PipelineStatus) {
    // Recovering before not ready: a submission in between is queued, not refused.
    status.recovering.store(true, Ordering::Release);
    broke(failure, status);
    recovery.get_or_insert_with(|| Recovery {
        since: std::time::Instant::now(),
        reason: failure.reason.clone(),
    });
}

/// How many stages to build with `alive` workers: as many as configured; fewer (one per live
/// worker) only to keep serving after a pipeline stood and lost workers, and only without
/// explicit cuts, which fix the stage count. None: wait for workers.
fn stage_count(config: &PipelineConfig, alive: usize, stood: bool) -> Option<usize> {
    if alive >= config.stages {
        Some(config.stages)
    } else if stood && config.cuts.is_none() && alive > 0 {
        Some(alive)
    } else {
        None
    }
}

/// Workers left out of builds for a while after they failed one (a joiner that cannot load
/// the model must not take down the pipeline that works without it). Each failure in a row
/// doubles the time, from 30 s up to an hour.
#[derive(Default)]
struct Quarantine {
    until: std::collections::HashMap<String, (std::time::Instant, u32)>,
}

impl Quarantine {
    fn add(&mut self, id: &str) {
        let strikes = self.until.get(id).map_or(0, |e| e.1) + 1;
        let secs = (30u64 << (strikes - 1).min(7)).min(3600);
        tracing::warn!(worker = id, seconds = secs, "leaving the worker out of pipeline builds");
        self.until.insert(
            id.to_string(),
            (std::time::Instant::now() + Duration::from_secs(secs), strikes),
        );
    }

    /// Whether a worker may be built on now.
    fn allows(&self, id: &str) -> bool {
        self.until.get(id).is_none_or(|e| std::time::Instant::now() >= e.0)
    }

    /// Workers left out now.
    fn left_out(&self) -> Vec<String> {
        let now = std::time::Instant::now();
        self.until
            .iter()
            .filter(|(_, e)| now < e.0)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// A worker that served in a pipeline is forgiven.
    fn clear(&mut self, workers: &[WorkerEntry]) {
        for w in workers {
            self.until.remove(&w.id);
        }
    }
}

/// Supervise forever: wait for workers, build, serve, and rebuild after failures, moving the
/// sequences of a broken pipeline to the next one.
pub(crate) async fn run(
    config: PipelineConfig,
    cluster: Arc<Cluster>,
    mut submit_rx: mpsc::Receiver<NewSequence>,
    status: Arc<PipelineStatus>,
) {
    zero_counters();
    let mut profiles = ProfileCache::default();
    let mut backlog = VecDeque::new();
    let mut recovery: Option<Recovery> = None;
    let mut quarantine = Quarantine::default();
    // A pipeline whose stages were loaded beside the old one and activated: served next
    // without a build.
    let mut switched: Option<Switched> = None;
    loop {
        status.ready.store(false, Ordering::Release);
        let (workers, pipeline, split) = match switched.take() {
            Some(next) => (next.workers, next.pipeline, next.split),
            None => {
                let mut workers: Vec<WorkerEntry> = cluster
                    .alive()
                    .into_iter()
                    .filter(|w| quarantine.allows(&w.id))
                    .collect();
                let Some(stages) = stage_count(&config, workers.len(), recovery.is_some()) else {
                    let why = "the pipeline is not ready: waiting for workers";
                    wait_without_pipeline(&recovery, &config, &mut backlog, &mut submit_rx, &status, why);
                    let changed = cluster.changed.notified();
                    let _ = tokio::time::timeout(cluster.heartbeat_interval, changed).await;
                    continue;
                };
                // Degraded (fewer stages than configured) until enough workers are alive again.
                let built_config = PipelineConfig {
                    stages,
                    ..config.clone()
                };
                workers.truncate(stages);
                // Traced with why it is built: the first build, or the re-plan that replaced a pipeline.
                let trigger = recovery.as_ref().map_or("start", |r| r.reason.as_str());
                let span = tracing::info_span!("pipeline.build", stages, wanted = config.stages, trigger);
                let built = build(&built_config, &workers, &mut profiles);
                let built = tracing::Instrument::instrument(built, span);
                // A build waits on workers (profiles, loads): meanwhile held requests still time out,
                // and a worker that stops heartbeating ends the wait instead of stalling it forever.
                let built = {
                    tokio::pin!(built);
                    let mut tick = tokio::time::interval(cluster.heartbeat_interval);
                    loop {
                        tokio::select! {
                            r = &mut built => break r,
                            _ = tick.tick() => {
                                if let Some(r) = &recovery {
                                    r.hold(&config, &mut backlog, &mut submit_rx, &status);
                                }
                                if let Some(i) = workers.iter().position(|w| !cluster.is_alive(&w.id)) {
                                    break Err(BuildError {
                                        message: format!("worker {} ({}) stopped heartbeating", workers[i].id, workers[i].address),
                                        worker: Some(i),
                                    });
                                }
                            }
                        }
                    }
                };
                match built {
                    Ok((pipeline, split)) => (workers, pipeline, split),
                    Err(e) => {
                        tracing::warn!("building the pipeline failed: {}; retrying", e.message);
                        if let Some(i) = e.worker {
                            quarantine.add(&workers[i].id);
                        }
                        let why = format!("the pipeline is not ready: {}", e.message);
                        wait_without_pipeline(&recovery, &config, &mut backlog, &mut submit_rx, &status, &why);
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                }
            }
        };
        let stages = workers.len();
        let workers = &workers[..];
        let built_config = PipelineConfig {
            stages,
            ..with_limits(&config, &pipeline.limits)
        };
        publish_limits(&pipeline.limits, &status);
        let assignment: Vec<_> = pipeline.stages.iter().map(|(a, _)| a.clone()).collect();
        for i in 0..stages {
            for (shape, secs) in split.stage_seconds(i) {
                metrics::gauge!("baton_stage_predicted_seconds", "stage" => i.to_string(), "shape" => shape).set(secs);
            }
        }
        *status.split.lock().unwrap_or_else(|e| e.into_inner()) = Some(split);
        let _poller = stage_stats::start(&pipeline, &status);
        let grow_to = (stages < config.stages).then_some(config.stages);
        let drift = watch_drift(&built_config, &pipeline, workers, &profiles, &status);
        let due = drift.as_ref().map(|d| d.due.clone());
        let left_out = quarantine.left_out();
        let end = match GrpcExecutor::open(&pipeline, &cluster, grow_to, left_out, due).await {
            Ok(mut exec) => {
                tracing::info!(?assignment, "pipeline ready");
                publish_ready(&status, assignment, pipeline.kv_blocks);
                quarantine.clear(workers);
                if let Some(r) = recovery.take() {
                    let down = r.since.elapsed().as_secs_f64();
                    tracing::info!(down_seconds = down, resumed = backlog.len(), "pipeline rebuilt");
                }
                let kv_blocks = pipeline.kv_blocks;
                engine::run(
                    &built_config,
                    &mut exec,
                    kv_blocks,
                    &mut submit_rx,
                    &mut backlog,
                    &status,
                )
                .await
            }
            Err(failure) => {
                // Nothing ran: keep waiting as before (the same recovery and its clock).
                tokio::time::sleep(Duration::from_secs(1)).await;
                EngineEnd::Interrupted(failure)
            }
        };
        match end {
            EngineEnd::Shutdown => return,
            EngineEnd::Interrupted(failure) => {
                pipeline_ended(&failure, &mut recovery, &status);
                if let Some(id) = &failure.worker_id {
                    cluster.remove(id);
                }
                // The next plan is made for the speeds the workers showed.
                if let Some(due) = drift.and_then(|d| d.due.lock().unwrap_or_else(|e| e.into_inner()).take()) {
                    profiles.slow(workers, &due.scales);
                    // Only a drained pipeline switches; after a failure the stages are rebuilt.
                    if let Some(staged) = due.staged.filter(|_| failure.planned == Some("measured_drift")) {
                        let pool = staged.kv_blocks * config.kv_block_size;
                        let limits = pipeline
                            .limits
                            .clone()
                            .within_pool(config.auto_limits, pool, config.max_context);
                        switched = activate(workers, staged, limits, &status).await;
                    }
                }
            }
        }
    }
}

/// A pipeline made by activating stages loaded beside the old ones.
struct Switched {
    workers: Vec<WorkerEntry>,
    pipeline: Pipeline,
    split: SplitInfo,
}

/// Switch every worker to the stage it loaded beside the served one, running with `limits`
/// (the old pipeline's, within the new stages' KV pool); None (after which the supervisor
/// builds as usual) when any worker fails to.
async fn activate(
    workers: &[WorkerEntry],
    staged: Staged,
    limits: StepLimits,
    status: &PipelineStatus,
) -> Option<Switched> {
    let activations = staged.stages.iter().map(|(a, c)| {
        let mut c = c.clone();
        let address = a.address.clone();
        async move {
            c.activate_stage(ActivateStageRequest {})
                .await
                .map_err(|e| format!("{address}: {}", e.message()))
        }
    });
    for r in futures::future::join_all(activations).await {
        if let Err(e) = r {
            tracing::warn!("activating the stages loaded beside the old pipeline failed ({e}); rebuilding");
            return None;
        }
    }
    let split = SplitInfo {
        policy: "measured",
        fits: staged.plan.fits.clone(),
        class_seconds: Vec::new(),
        note: Some("re-planned while serving: stages loaded beside the old ones, then activated".into()),
    };
    if let Some(last) = status.last_replan.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        last.push_str(" (switched to stages loaded beside the old ones)");
    }
    tracing::info!(ranges = ?staged.plan.ranges, "switched to the stages loaded beside the old pipeline");
    Some(Switched {
        workers: workers.to_vec(),
        pipeline: Pipeline {
            stages: staged.stages,
            kv_blocks: staged.kv_blocks,
            limits,
        },
        split,
    })
}

/// Watch a measured split's stage times against its plan, when live re-planning is on.
fn watch_drift(
    config: &PipelineConfig,
    pipeline: &Pipeline,
    workers: &[WorkerEntry],
    profiles: &ProfileCache,
    status: &Arc<PipelineStatus>,
) -> Option<DriftWatch> {
    let policy = config.live_replan?;
    let split = status.split.lock().unwrap_or_else(|e| e.into_inner()).clone()?;
    if split.policy != "measured" || pipeline.stages.len() < 2 {
        return None;
    }
    let plan = PlanInputs {
        layers: config.planned_layers(),
        costs: profiles.costs_for(workers)?,
        ranges: pipeline.stages.iter().map(|(a, _)| a.layers.clone()).collect(),
        shapes: split::planning_shapes(config).to_vec(),
    };
    let staging = Staging {
        config: config.clone(),
        workers: workers.to_vec(),
    };
    Some(replan::watch(pipeline, plan, policy, status.clone(), staging))
}

/// Counters exist from the start (at 0), so dashboards can rate() them before any failure.
fn zero_counters() {
    metrics::counter!("baton_pipeline_failures_total").increment(0);
    for reason in ["stage_failed", "workers_joined", "measured_drift"] {
        metrics::counter!("baton_replans_total", "reason" => reason).increment(0);
    }
    for cause in ["stage_failed", "replan"] {
        metrics::counter!("baton_sequence_migrations_total", "cause" => cause).increment(0);
    }
    metrics::counter!("baton_preemptions_total").increment(0);
    metrics::gauge!("baton_pipeline_ready").set(0.0);
}

/// A pipeline stands: its stages and pool size, then `ready`, so anyone who sees it ready
/// also sees them.
fn publish_ready(status: &PipelineStatus, assignment: Vec<StageAssignment>, kv_blocks: usize) {
    let stages = assignment.len();
    *status.assignment.lock().unwrap_or_else(|e| e.into_inner()) = assignment;
    status.kv_blocks_total.store(kv_blocks as u64, Ordering::Relaxed);
    status.ready.store(true, Ordering::Release);
    status.recovering.store(false, Ordering::Release);
    metrics::gauge!("baton_pipeline_ready").set(1.0);
    metrics::gauge!("baton_pipeline_stages").set(stages as f64);
}

/// Count and log a pipeline that ends: broken, or replaced by a better one.
fn broke(failure: &StageFailure, status: &PipelineStatus) {
    let reason = if let Some(why) = failure.planned {
        tracing::info!("rebuilding the pipeline: {}", failure.reason);
        why
    } else {
        tracing::error!("pipeline broke: {}", failure.reason);
        metrics::counter!("baton_pipeline_failures_total").increment(1);
        "stage_failed"
    };
    metrics::counter!("baton_replans_total", "reason" => reason).increment(1);
    metrics::gauge!("baton_pipeline_ready").set(0.0);
    status.replans.fetch_add(1, Ordering::Relaxed);
    *status.last_replan.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{reason}: {}", failure.reason));
    status.ready.store(false, Ordering::Release);
}

/// Builds the whole model's stage again after the in-process one failed.
pub type StageLoader = Arc<dyn Fn() -> Result<Stage, String> + Send + Sync>;

/// Supervise the one in-process stage: serve on `stage` with the engine, and after a
/// failure (a panic in the stage thread) load a new one with `reload` and serve again.
pub(crate) async fn run_local(
    config: PipelineConfig,
    stage: Stage,
    reload: StageLoader,
    mut submit_rx: mpsc::Receiver<NewSequence>,
    status: Arc<PipelineStatus>,
) {
    zero_counters();
    let mut next = Some(stage);
    let mut backlog = VecDeque::new();
    let mut recovery: Option<Recovery> = None;
    loop {
        status.ready.store(false, Ordering::Release);
        metrics::gauge!("baton_pipeline_ready").set(0.0);
        let stage = match next.take() {
            Some(s) => s,
            None => {
                let reload = reload.clone();
                let loaded = tokio::task::spawn_blocking(move || reload()).await;
                match loaded.map_err(|e| e.to_string()).and_then(|r| r) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!("loading the in-process stage failed: {e}; retrying");
                        let why = format!("the model is not ready: {e}");
                        wait_without_pipeline(&recovery, &config, &mut backlog, &mut submit_rx, &status, &why);
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                }
            }
        };
        let info = stage.info();
        let kv = stage.backend().kv();
        let (kv_blocks, state_slots) = (kv.blocks, (kv.state_slots > 0).then_some(kv.state_slots));
        let assignment = StageAssignment {
            worker_id: LOCAL_WORKER.into(),
            address: "in-process".into(),
            layers: info.layer_start as usize..info.layer_end as usize,
        };
        let mut exec = match LocalExecutor::start(stage, status.clone()) {
            Ok(e) => e,
            Err(failure) => {
                broke(&failure, &status);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        // Nothing here is profiled: the limits left open are bounded by the KV pool and, for a
        // model with linear-attention layers, by the state slots the stage could keep.
        let limits = sizing::size(
            config.auto_limits,
            config.max_running,
            config.max_batch_tokens,
            1,
            None,
            kv_blocks * config.kv_block_size,
            config.max_context,
        )
        .within_state(config.auto_limits, state_slots);
        publish_limits(&limits, &status);
        let sized = with_limits(&config, &limits);
        publish_ready(&status, vec![assignment], kv_blocks);
        recovery = None;
        match engine::run(&sized, &mut exec, kv_blocks, &mut submit_rx, &mut backlog, &status).await {
            EngineEnd::Shutdown => return,
            EngineEnd::Interrupted(failure) => pipeline_ended(&failure, &mut recovery, &status),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_worker::model::spec::CacheBytes;

    fn worker(kv_cache_bytes: u64) -> WorkerEntry {
        WorkerEntry {
            id: "w".into(),
            address: "127.0.0.1:1".into(),
            device_kind: "cpu".into(),
            cores: 1,
            memory_bytes: 1 << 30,
            features: Vec::new(),
            kv_cache_bytes,
            metrics_address: String::new(),
            seq: 0,
            last_seen: std::time::Instant::now(),
        }
    }

    /// The tiny Qwen3-Next fixture's configuration: layers L L F L L (linear attention, full
    /// attention).
    fn tiny_qwen3_next() -> baton_shared::model_config::ModelConfig {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny/qwen3_next");
        let files = baton_shared::model_files::ModelFiles::open(&dir).unwrap();
        files.config().unwrap()
    }

    #[test]
    fn recurrent_state_copies_come_out_of_the_kv_budget_before_blocks() {
        let cfg = tiny_qwen3_next();
        let config = PipelineConfig {
            max_running: 4,
            state_snapshots: 4,
            ..PipelineConfig::new("m", &cfg, vec![])
        };
        let all = 0..cfg.num_layers;
        let bytes = config.cache_bytes(all.clone());
        assert!(bytes.per_state > 0 && bytes.per_block > 0, "{bytes:?}");
        assert_eq!(
            bytes.per_block,
            2 * 16 * cfg.kv_dim() * 4,
            "one attention layer's f32 keys and values"
        );
        // Room for 10 blocks beside 4 slots and 4 snapshots.
        let budget = bytes.total(10, 8) as u64;
        assert_eq!(
            kv_blocks(&config, &[worker(budget)], std::slice::from_ref(&all)).unwrap(),
            10
        );
        // Without snapshots the same budget holds more blocks.
        let fewer = PipelineConfig {
            state_snapshots: 0,
            ..config.clone()
        };
        let more = 10 + 4 * bytes.per_state / bytes.per_block;
        assert_eq!(
            kv_blocks(&fewer, &[worker(budget)], std::slice::from_ref(&all)).unwrap(),
            more
        );
        // A budget the state copies alone fill holds no block: the error says why.
        let e = kv_blocks(&config, &[worker(bytes.total(0, 8) as u64)], &[all]).unwrap_err();
        assert!(e.message.contains("8 recurrent-state copies"), "{}", e.message);
        // A stage of linear-attention layers only stores no K/V: the other stage bounds it.
        let ranges = [0..2, 2..cfg.num_layers];
        let linear = config.cache_bytes(ranges[0].clone());
        assert_eq!(linear.per_block, 0);
        let stage1 = config.cache_bytes(ranges[1].clone());
        let workers = [worker(linear.total(0, 8) as u64), worker(stage1.total(7, 8) as u64)];
        assert_eq!(kv_blocks(&config, &workers, &ranges).unwrap(), 7);
    }

    #[test]
    fn the_state_bound_counts_a_slot_and_the_planned_blocks_per_sequence() {
        let cfg = tiny_qwen3_next();
        let config = PipelineConfig {
            state_snapshots: 4,
            ..PipelineConfig::new("m", &cfg, vec![])
        };
        let ranges = [0..2, 2..cfg.num_layers];
        // The tiny model's context (256 positions) is what a sequence is planned to hold.
        let blocks = cfg.max_position_embeddings.min(sizing::PLANNED_POSITIONS).div_ceil(16);
        let (s0, s1) = (
            config.cache_bytes(ranges[0].clone()),
            config.cache_bytes(ranges[1].clone()),
        );
        let budget = |b: CacheBytes, n: usize| (b.total(0, 4) + n as u128 * b.total(blocks, 1)) as u64;
        let workers = [worker(budget(s0, 9)), worker(budget(s1, 6))];
        assert_eq!(state_bound(&config, &workers, &ranges), Some(6));
        let workers = [worker(budget(s0, 3)), worker(budget(s1, 6))];
        assert_eq!(state_bound(&config, &workers, &ranges), Some(3));
        // A model without recurrent state is not bounded by it.
        let plain = PipelineConfig {
            layer_caches: Vec::new(),
            ..config.clone()
        };
        assert_eq!(state_bound(&plain, &workers, &ranges), None);
    }
}
