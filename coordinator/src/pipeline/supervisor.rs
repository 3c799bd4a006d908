//! Builds the pipeline from registered workers (layer ranges from `split`, LoadStage on each, a
//! Forward stream into stage 0), runs the engine on it, and starts over when a stage fails or
//! leaves. [`run_local`] does the same for the one in-process stage of `--workers 0`.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use baton_shared::proto::LoadStageRequest;
use baton_worker::kv_cache::PagedKv;
use baton_worker::service::{AuthedWorkerClient, MAX_MESSAGE, connect_worker};
use baton_worker::stage::Stage;
use tokio::sync::mpsc;

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

/// A built pipeline: clients for every stage, in order, and the KV blocks every stage holds.
pub(crate) struct Pipeline {
    pub stages: Vec<(StageAssignment, AuthedWorkerClient)>,
    pub kv_blocks: usize,
}

/// The most KV blocks every stage's pool fits in its worker's budget (and the configured cap).
fn kv_blocks(config: &PipelineConfig, workers: &[WorkerEntry], ranges: &[Range<usize>]) -> Result<usize, String> {
    let mut blocks = config.kv_max_blocks.unwrap_or(usize::MAX);
    for (w, layers) in workers.iter().zip(ranges) {
        let per_block = PagedKv::bytes_per_block(layers.len(), config.kv_dim, config.kv_block_size, config.kv_dtype);
        let fits = (w.kv_cache_bytes / per_block as u64) as usize;
        if fits == 0 {
            return Err(format!(
                "worker {} ({}) has a KV budget of {} bytes, less than one block of {} positions for layers {:?} ({per_block} bytes): raise its kv_cache_mib",
                w.id, w.address, w.kv_cache_bytes, config.kv_block_size, layers
            ));
        }
        blocks = blocks.min(fits);
    }
    Ok(blocks)
}

async fn build(
    config: &PipelineConfig,
    workers: &[WorkerEntry],
    profiles: &mut ProfileCache,
    status: &PipelineStatus,
) -> Result<(Pipeline, SplitInfo), String> {
    let mut clients = Vec::with_capacity(workers.len());
    for (i, w) in workers.iter().enumerate() {
        let client = connect_worker(&w.address, &config.cluster_token)
            .await
            .map_err(|e| format!("stage {i} ({}): {}", w.address, e.message()))?;
        clients.push(client.max_encoding_message_size(MAX_MESSAGE));
    }
    let (mut ranges, mut split) = split::choose(config, workers, &clients, profiles, status).await?;
    let kv_blocks = match kv_blocks(config, workers, &ranges) {
        Ok(b) => b,
        // The plan weighs weights, not KV: a stage it loads up may leave no room for a block.
        Err(e) if split.policy == "measured" => {
            tracing::warn!("the measured split leaves no KV room ({e}); splitting evenly");
            ranges = even_split(config.num_layers, config.stages);
            split = SplitInfo::unmeasured("even", Some(e));
            kv_blocks(config, workers, &ranges)?
        }
        Err(e) => return Err(e),
    };
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
        };
        let label = format!("stage {i} ({}, layers {:?})", a.address, a.layers);
        async move {
            client
                .load_stage(req)
                .await
                .map_err(|e| format!("{label}: {}", e.message()))
        }
    });
    for r in futures::future::join_all(loads).await {
        r?;
    }
    Ok((Pipeline { stages, kv_blocks }, split))
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

/// Supervise forever: wait for workers, build, serve, and rebuild after failures.
pub(crate) async fn run(
    config: PipelineConfig,
    cluster: Arc<Cluster>,
    mut submit_rx: mpsc::Receiver<NewSequence>,
    status: Arc<PipelineStatus>,
) {
    zero_counters();
    let mut profiles = ProfileCache::default();
    loop {
        status.ready.store(false, Ordering::Release);
        let workers = cluster.alive();
        if workers.len() < config.stages {
            reject_waiting(&mut submit_rx, "the pipeline is not ready: waiting for workers");
            let changed = cluster.changed.notified();
            let _ = tokio::time::timeout(cluster.heartbeat_interval, changed).await;
            continue;
        }
        let workers = &workers[..config.stages];
        let span = tracing::info_span!("pipeline.build", stages = config.stages);
        let (pipeline, split) =
            match tracing::Instrument::instrument(build(&config, workers, &mut profiles, &status), span).await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!("building the pipeline failed: {e}; retrying");
                    reject_waiting(&mut submit_rx, &format!("the pipeline is not ready: {e}"));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
        let assignment: Vec<_> = pipeline.stages.iter().map(|(a, _)| a.clone()).collect();
        tracing::info!(?assignment, "pipeline ready");
        for (i, secs) in split.predicted_seconds.iter().enumerate() {
            metrics::gauge!("baton_stage_predicted_seconds", "stage" => i.to_string()).set(*secs);
        }
        *status.split.lock().unwrap_or_else(|e| e.into_inner()) = Some(split);
        publish_ready(&status, assignment, pipeline.kv_blocks);
        let _poller = stage_stats::start(&pipeline, &status);
        let end = match GrpcExecutor::open(&pipeline, &cluster).await {
            Ok(mut exec) => engine::run(&config, &mut exec, pipeline.kv_blocks, &mut submit_rx, &status).await,
            Err(failure) => EngineEnd::StageFailed(failure),
        };
        match end {
            EngineEnd::Shutdown => return,
            EngineEnd::StageFailed(failure) => {
                broke(&failure, &status);
                if let Some(id) = failure.worker_id {
                    cluster.remove(&id);
                }
            }
        }
    }
}

/// Counters exist from the start (at 0), so dashboards can rate() them before any failure.
fn zero_counters() {
    metrics::counter!("baton_pipeline_failures_total").increment(0);
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
    metrics::gauge!("baton_pipeline_ready").set(1.0);
    metrics::gauge!("baton_pipeline_stages").set(stages as f64);
}

/// Count and log a pipeline that broke.
fn broke(failure: &StageFailure, status: &PipelineStatus) {
    tracing::error!("pipeline broke: {}", failure.reason);
    metrics::gauge!("baton_pipeline_ready").set(0.0);
    metrics::counter!("baton_pipeline_failures_total").increment(1);
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
                        reject_waiting(&mut submit_rx, &format!("the model is not ready: {e}"));
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                }
            }
        };
        let info = stage.info();
        let kv_blocks = stage.backend().kv().blocks;
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
        publish_ready(&status, vec![assignment], kv_blocks);
        match engine::run(&config, &mut exec, kv_blocks, &mut submit_rx, &status).await {
            EngineEnd::Shutdown => return,
            EngineEnd::StageFailed(failure) => broke(&failure, &status),
        }
    }
}
