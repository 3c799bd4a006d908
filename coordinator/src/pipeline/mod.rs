//! The pipeline generator: requests in, token streams out, by driving micro-batches through
//! the chain of workers. `supervisor` builds (and rebuilds) the pipeline from registered
//! workers; `steps` runs the step loop while it stands.

mod steps;
mod supervisor;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use baton_shared::proto::Dtype;
use tokio::sync::mpsc;

use crate::generation::{GenerationRequest, Generator, SubmitError, TokenEvent};
use crate::registry::Cluster;

pub use supervisor::StageAssignment;

/// What the pipeline needs to know about the model and the cluster.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    /// Model as workers should resolve it (path or known name).
    pub model: String,
    pub num_layers: usize,
    pub vocab_size: usize,
    pub max_context: usize,
    pub eos_ids: Vec<u32>,
    /// Stages to build (workers used, in registration order).
    pub stages: usize,
    /// Explicit layer boundaries between stages (`stages - 1` increasing cut points); None
    /// splits evenly.
    pub cuts: Option<Vec<usize>>,
    pub cluster_token: String,
    /// Wire type of hidden states between stages.
    pub activation_dtype: Dtype,
    /// Weight format the workers hold (`f32`, `q8_0`).
    pub weights: String,
    /// Requests waiting to start, beyond which submissions get 429.
    pub max_queue: usize,
    /// Sequences generated at once (each holds KV on every stage); others wait in the queue.
    pub max_running: usize,
    /// Tokens per step (decode tokens first, then prompt chunks), bounding every stage's batch.
    pub max_batch_tokens: usize,
}

/// A new sequence handed to the step loop.
#[derive(Debug)]
pub(crate) struct NewSequence {
    pub id: u64,
    /// When the request was accepted (for time-to-first-token).
    pub submitted: std::time::Instant,
    pub req: GenerationRequest,
    pub tx: mpsc::Sender<TokenEvent>,
}

/// Shared between the generator handle and the supervisor task.
#[derive(Debug, Default)]
pub struct PipelineStatus {
    pub ready: AtomicBool,
    /// Sequences currently holding KV on the workers.
    pub active_sequences: AtomicU64,
    /// Most micro-batches ever in flight at once (at most one per stage).
    pub max_in_flight: AtomicU64,
    /// The current assignment, for `/admin` views and tests.
    pub assignment: std::sync::Mutex<Vec<StageAssignment>>,
}

/// Generator backed by a pipeline of gRPC workers.
pub struct PipelineGenerator {
    config: PipelineConfig,
    cluster: Arc<Cluster>,
    submit_tx: mpsc::Sender<NewSequence>,
    next_id: AtomicU64,
    pub status: Arc<PipelineStatus>,
}

impl PipelineGenerator {
    /// Start the supervisor; the pipeline becomes ready once enough workers registered.
    pub fn start(config: PipelineConfig, cluster: Arc<Cluster>) -> Self {
        let (submit_tx, submit_rx) = mpsc::channel(config.max_queue.max(1));
        let status = Arc::new(PipelineStatus::default());
        tokio::spawn(supervisor::run(
            config.clone(),
            cluster.clone(),
            submit_rx,
            status.clone(),
        ));
        Self {
            config,
            cluster,
            submit_tx,
            next_id: AtomicU64::new(1),
            status,
        }
    }
}

impl Generator for PipelineGenerator {
    fn submit(&self, req: GenerationRequest) -> Result<mpsc::Receiver<TokenEvent>, SubmitError> {
        if !self.status.ready.load(Ordering::Acquire) {
            return Err(SubmitError::Unavailable(format!(
                "the pipeline is not ready (waiting for {} worker(s) to register and load their layers)",
                self.config.stages
            )));
        }
        req.check(self.config.vocab_size, self.config.max_context)?;
        let (tx, rx) = mpsc::channel(req.params.max_tokens.clamp(1, 4096) + 1);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.submit_tx
            .try_send(NewSequence {
                id,
                submitted: std::time::Instant::now(),
                req,
                tx,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => {
                    SubmitError::Overloaded(format!("more than {} requests are waiting", self.config.max_queue))
                }
                mpsc::error::TrySendError::Closed(_) => SubmitError::Unavailable("the pipeline has shut down".into()),
            })?;
        Ok(rx)
    }

    fn ready(&self) -> bool {
        self.status.ready.load(Ordering::Acquire)
    }

    fn describe(&self) -> serde_json::Value {
        let assignment = self.status.assignment.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let stages: Vec<_> = assignment
            .iter()
            .enumerate()
            .map(|(i, a)| {
                serde_json::json!({
                    "stage": i, "worker_id": a.worker_id, "address": a.address,
                    "layer_start": a.layers.start, "layer_end": a.layers.end,
                })
            })
            .collect();
        let workers: Vec<_> = self
            .cluster
            .alive()
            .into_iter()
            .map(|w| {
                serde_json::json!({
                    "worker_id": w.id, "address": w.address, "device": w.device_kind, "cores": w.cores,
                    "memory_bytes": w.memory_bytes, "features": w.features,
                    "last_seen_ms_ago": w.last_seen.elapsed().as_millis() as u64,
                })
            })
            .collect();
        serde_json::json!({
            "mode": "pipeline",
            "ready": self.ready(),
            "num_layers": self.config.num_layers,
            "stages_wanted": self.config.stages,
            "stages": stages,
            "workers": workers,
            "running_sequences": self.status.active_sequences.load(Ordering::Relaxed),
            "max_micro_batches_in_flight": self.status.max_in_flight.load(Ordering::Relaxed),
            "max_running": self.config.max_running,
            "max_queue": self.config.max_queue,
        })
    }
}
