//! The executor over a pipeline of gRPC workers: micro-batches go down stage 0's Forward
//! stream and results come back up it in order; stages are watched through the registry's
//! heartbeats and probed with Health when a stream breaks.

use std::time::Duration;

use baton_shared::proto::{BatchResult, FreeRequest, HealthRequest, MicroBatch};
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{Executor, StageFailure};
use crate::pipeline::Pipeline;
use crate::pipeline::replan::DueSlot;
use crate::registry::Cluster;

/// A built pipeline of workers, with the Forward stream into its first stage open.
pub(crate) struct GrpcExecutor<'a> {
    pipeline: &'a Pipeline,
    cluster: &'a Cluster,
    batch_tx: mpsc::Sender<MicroBatch>,
    results: tonic::Streaming<BatchResult>,
    tick: tokio::time::Interval,
    /// This pipeline has fewer stages than wanted: rebuild once this many workers are alive,
    /// not counting those left out of builds (they failed one).
    grow_to: Option<usize>,
    left_out: Vec<String>,
    /// Where the drift watch leaves a due re-plan (measured splits only).
    drift: Option<DueSlot>,
    /// A planned rebuild found due by the latest liveness check (workers joined).
    grow_due: Option<StageFailure>,
}

impl<'a> GrpcExecutor<'a> {
    /// Open the Forward stream into stage 0. A pipeline built with fewer stages than wanted
    /// asks for a planned rebuild once `grow_to` workers are alive.
    pub async fn open(
        pipeline: &'a Pipeline,
        cluster: &'a Cluster,
        grow_to: Option<usize>,
        left_out: Vec<String>,
        drift: Option<DueSlot>,
    ) -> Result<Self, StageFailure> {
        let mut stage0 = pipeline.stages[0].1.clone();
        let (batch_tx, batch_rx) = mpsc::channel::<MicroBatch>(4);
        let results = stage0
            .forward(ReceiverStream::new(batch_rx))
            .await
            .map_err(|e| StageFailure::new(format!("stage 0 refused the forward stream: {}", e.message())))?
            .into_inner();
        Ok(Self {
            pipeline,
            cluster,
            batch_tx,
            results,
            tick: tokio::time::interval(cluster.heartbeat_interval),
            grow_to,
            left_out,
            drift,
            grow_due: None,
        })
    }

    /// A stage whose worker stopped heartbeating.
    fn dead_stage(&self) -> Option<StageFailure> {
        let (a, _) = self
            .pipeline
            .stages
            .iter()
            .find(|(a, _)| !self.cluster.is_alive(&a.worker_id))?;
        Some(StageFailure::of_worker(
            format!("worker {} ({}) stopped heartbeating", a.worker_id, a.address),
            &a.worker_id,
        ))
    }

    /// The heartbeat tick's checks: a stage that died, else whether a degraded pipeline can
    /// grow (left in `grow_due`).
    fn on_tick(&mut self) -> Option<StageFailure> {
        let dead = self.dead_stage();
        if dead.is_none() {
            self.check_grow();
        }
        dead
    }

    /// A degraded pipeline: once enough workers are alive (registered, or heartbeating again),
    /// a rebuild with every stage is due. Checked on the heartbeat tick and when membership
    /// changes, not per step.
    fn check_grow(&mut self) {
        let Some(want) = self.grow_to else { return };
        let alive = self
            .cluster
            .alive()
            .iter()
            .filter(|w| !self.left_out.contains(&w.id))
            .count();
        if alive >= want && self.grow_due.is_none() {
            let have = self.pipeline.stages.len();
            let why = format!("{alive} workers are alive: rebuilding the {have}-stage pipeline with {want} stages");
            self.grow_due = Some(StageFailure::planned("workers_joined", why));
        }
    }

    /// A broken stream: probe every stage; the first that does not answer is the failed one.
    async fn broken(&self, reason: String) -> StageFailure {
        for (a, client) in &self.pipeline.stages {
            let mut client = client.clone();
            let ok = tokio::time::timeout(Duration::from_secs(2), client.health(HealthRequest {})).await;
            if !matches!(ok, Ok(Ok(_))) || !self.cluster.is_alive(&a.worker_id) {
                return StageFailure::of_worker(reason, &a.worker_id);
            }
        }
        StageFailure::new(reason)
    }
}

impl Executor for GrpcExecutor<'_> {
    fn depth(&self) -> usize {
        self.pipeline.stages.len()
    }

    async fn submit(&mut self, batch: MicroBatch) -> Result<(), StageFailure> {
        if self.batch_tx.send(batch).await.is_err() {
            return Err(self.broken("stage 0 closed the forward stream".into()).await);
        }
        Ok(())
    }

    async fn next_result(&mut self) -> Result<BatchResult, StageFailure> {
        let reply = loop {
            tokio::select! {
                r = self.results.next() => break r,
                _ = self.tick.tick() => {
                    if let Some(f) = self.on_tick() {
                        return Err(f);
                    }
                }
            }
        };
        match reply {
            Some(Ok(r)) => Ok(r),
            Some(Err(e)) => Err(self
                .broken(format!("pipeline stage unavailable: {}", e.message()))
                .await),
            None => Err(self.broken("stage 0 ended the forward stream".into()).await),
        }
    }

    fn free(&self, ids: Vec<u64>) {
        if ids.is_empty() {
            return;
        }
        for (_, client) in &self.pipeline.stages {
            let mut client = client.clone();
            let ids = ids.clone();
            tokio::spawn(async move {
                if let Err(e) = client.free(FreeRequest { seq_ids: ids }).await {
                    tracing::debug!(error = %e.message(), "free failed");
                }
            });
        }
    }

    async fn watch(&mut self) -> StageFailure {
        loop {
            if let Some(planned) = self.replan() {
                return planned;
            }
            tokio::select! {
                _ = self.tick.tick() => {
                    if let Some(f) = self.on_tick() {
                        return f;
                    }
                }
                () = self.cluster.changed.notified() => self.check_grow(),
            }
        }
    }

    fn replan(&mut self) -> Option<StageFailure> {
        if let Some(slot) = &self.drift
            && let Some(due) = slot.lock().unwrap_or_else(|e| e.into_inner()).as_ref()
        {
            return Some(StageFailure::planned("measured_drift", due.reason.clone()));
        }
        self.grow_due.take()
    }
}
