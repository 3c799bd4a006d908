//! The pipeline generator: requests in, token streams out, by driving micro-batches through
//! the chain of workers. `supervisor` builds (and rebuilds) the pipeline from registered
//! workers and keeps `crate::engine` running on them while they stand.

pub(crate) mod kv_blocks;
pub mod replan;
pub mod sizing;
pub mod split;
mod stage_stats;
mod supervisor;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use baton_shared::model_config::ModelConfig;
use baton_shared::proto::Dtype;
use baton_worker::kv_cache::KvDtype;
use baton_worker::model::spec::{CacheBytes, CacheSpec, LayerClass, LayerSpec};
use baton_worker::stage::Stage;
use tokio::sync::mpsc;

use crate::generation::{GenerationRequest, Generator, SubmitError, TokenEvent};
use crate::planner::{LayerTable, SplitPolicy, TableClass, TableLayer};
use crate::registry::Cluster;
use crate::speculative::SpeculativeConfig;

pub use stage_stats::StageLive;
pub(crate) use supervisor::Pipeline;
pub use supervisor::{StageAssignment, StageLoader};

/// What the pipeline needs to know about the model and the cluster.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    /// Model as workers should resolve it (path or known name).
    pub model: String,
    pub num_layers: usize,
    /// Each layer's class and weight, from the layers the model declares (what the planner
    /// costs each layer by); empty: every layer alike.
    pub layer_table: LayerTable,
    pub vocab_size: usize,
    pub max_context: usize,
    pub eos_ids: Vec<u32>,
    /// Stages to build (workers used, in registration order).
    pub stages: usize,
    /// Explicit layer boundaries between stages (`stages - 1` increasing cut points); None
    /// splits by `split`.
    pub cuts: Option<Vec<usize>>,
    /// How layers are split without explicit cuts: from measured worker costs, or evenly.
    pub split: SplitPolicy,
    /// The token and TLS identity the coordinator presents to workers.
    pub peer: baton_shared::auth::PeerAuth,
    /// Wire type of hidden states between stages.
    pub activation_dtype: Dtype,
    /// Weight format the workers hold (`f32`, `q8_0`, `q4_0`, `q4_1`, `native`).
    pub weights: String,
    /// Requests waiting to start, beyond which submissions get 429.
    pub max_queue: usize,
    /// Sequences generated at once (each holds KV on every stage); others wait in the queue.
    /// When `auto_limits.max_running`, the value used where nothing is measured.
    pub max_running: usize,
    /// Tokens per step (decode tokens first, then prompt chunks), bounding every stage's batch.
    /// When `auto_limits.max_batch_tokens`, the value used where nothing is measured.
    pub max_batch_tokens: usize,
    /// The limits each built pipeline sizes from its workers' profiles and KV pool
    /// (`sizing`) instead of taking the values above.
    pub auto_limits: sizing::AutoLimits,
    /// Width of one position's keys (or values) per layer: `num_kv_heads × head_dim`.
    pub kv_dim: usize,
    /// What each layer caches, as its architecture declares (K/V per position, or a
    /// recurrent state per sequence); empty: every layer K/V of `kv_dim`.
    pub layer_caches: Vec<CacheSpec>,
    /// Positions per KV block.
    pub kv_block_size: usize,
    /// At most this many KV blocks even if the workers' budgets allow more (tests and
    /// deliberate limits); None: as many as every stage's budget fits.
    pub kv_max_blocks: Option<usize>,
    /// How every stage stores keys and values.
    pub kv_dtype: KvDtype,
    /// Reuse the K/V of full blocks whose tokens a new prompt starts with.
    pub prefix_caching: bool,
    /// Recurrent-state snapshots every stage with linear-attention layers keeps for the prefix
    /// cache (ids `0..state_snapshots`, allocated with the blocks); 0 for other models, and
    /// for a hybrid one without prefix caching.
    pub state_snapshots: usize,
    /// The model has linear-attention layers (a recurrent state per sequence): its prefix
    /// cache needs state snapshots.
    pub recurrent_state: bool,
    /// Times a sequence may move to a rebuilt pipeline after a stage failed; one more failure
    /// ends it with a retriable error.
    pub max_migrations: u32,
    /// Longest a request waits for admission: in the queue of a running pipeline, or for a
    /// broken one to be rebuilt (then it fails with a retriable error).
    pub queue_timeout: std::time::Duration,
    /// Re-plan a measured split while serving when stage times drift from it; None: plan
    /// once per build.
    pub live_replan: Option<replan::ReplanPolicy>,
    /// Speculative decoding: the drafter and how many tokens decode steps may propose.
    pub speculative: SpeculativeConfig,
}

/// Moves a sequence may make to a rebuilt pipeline by default.
pub const DEFAULT_MAX_MIGRATIONS: u32 = 3;
/// Default [`PipelineConfig::queue_timeout`].
pub const DEFAULT_QUEUE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Each layer's class and its weight against its class's first layer, and each class's first
/// layer against layer 0, by the weights the architecture module declares: the time by the
/// weights a position reads, the bytes by all of them (every expert).
pub fn layer_table(config: &ModelConfig) -> LayerTable {
    let arch = baton_worker::model::registry::for_config(config);
    let specs: Vec<LayerSpec> = (0..config.num_layers).map(|l| arch.layer(config, l).spec()).collect();
    let Some(layer0) = specs.first() else {
        return LayerTable::default();
    };
    let ratio = |a: usize, b: usize| a as f64 / b.max(1) as f64;
    let mut table = LayerTable::default();
    let mut firsts: Vec<(LayerClass, LayerSpec)> = Vec::new();
    for s in &specs {
        let class = match firsts.iter().position(|(c, _)| *c == s.class()) {
            Some(c) => c,
            None => {
                firsts.push((s.class(), *s));
                table.classes.push(TableClass {
                    name: s.class().name().to_string(),
                    time: ratio(s.active_params, layer0.active_params),
                    bytes: ratio(s.weight_params, layer0.weight_params),
                });
                firsts.len() - 1
            }
        };
        let first = &firsts[class].1;
        table.layers.push(TableLayer {
            class,
            time: ratio(s.active_params, first.active_params),
            bytes: ratio(s.weight_params, first.weight_params),
        });
    }
    table
}

/// What each layer of `config` caches, by the cache its architecture module declares.
pub fn layer_caches(config: &ModelConfig) -> Vec<CacheSpec> {
    let arch = baton_worker::model::registry::for_config(config);
    (0..config.num_layers)
        .map(|l| arch.layer(config, l).spec().cache)
        .collect()
}

impl PipelineConfig {
    /// The layers as the planner costs them: the model's table, or every layer alike when
    /// there is none for this layer count.
    pub fn planned_layers(&self) -> LayerTable {
        match self.layer_table.len() == self.num_layers {
            true => self.layer_table.clone(),
            false => LayerTable::uniform(self.num_layers),
        }
    }

    /// Bytes one KV block and one copy of a sequence's recurrent state take on `layers`.
    pub fn cache_bytes(&self, layers: std::ops::Range<usize>) -> CacheBytes {
        let value_bytes = self.kv_dtype.bytes();
        match self.layer_caches.get(layers.clone()) {
            Some(caches) if !self.layer_caches.is_empty() => {
                CacheBytes::of(caches.iter().copied(), self.kv_block_size, value_bytes)
            }
            _ => CacheBytes {
                per_block: layers.len() * 2 * self.kv_block_size * self.kv_dim * value_bytes,
                per_state: 0,
            },
        }
    }

    /// Recurrent-state copies a stage with linear-attention layers keeps: a slot per running
    /// sequence and the prefix cache's snapshots.
    pub fn state_copies(&self) -> usize {
        self.max_running + self.state_snapshots
    }

    /// A configuration for `model` (as workers should resolve it) with the defaults of
    /// `baton serve`: one stage per worker is set by the caller through `stages`; f32 weights,
    /// activations and KV, 64 queued and 8 running requests, 128 tokens a step, blocks of 16
    /// positions, the measured split and prefix caching on, 3 migrations per request and a
    /// 60-second queue timeout, live re-planning on.
    pub fn new(model: impl Into<String>, config: &ModelConfig, eos_ids: Vec<u32>) -> Self {
        Self {
            model: model.into(),
            num_layers: config.num_layers,
            layer_table: layer_table(config),
            vocab_size: config.vocab_size,
            max_context: config.max_position_embeddings,
            eos_ids,
            stages: 1,
            cuts: None,
            split: SplitPolicy::Measured,
            peer: baton_shared::auth::PeerAuth::plaintext(""),
            activation_dtype: Dtype::F32,
            weights: "f32".into(),
            max_queue: 64,
            max_running: sizing::UNMEASURED_MAX_RUNNING,
            max_batch_tokens: sizing::UNMEASURED_MAX_BATCH_TOKENS,
            auto_limits: sizing::AutoLimits::NONE,
            kv_dim: config.kv_dim(),
            layer_caches: layer_caches(config),
            kv_block_size: 16,
            kv_max_blocks: None,
            kv_dtype: KvDtype::F32,
            prefix_caching: true,
            state_snapshots: match config.linear_attention {
                Some(_) => baton_shared::settings::DEFAULT_STATE_SNAPSHOTS,
                None => 0,
            },
            recurrent_state: config.linear_attention.is_some(),
            max_migrations: DEFAULT_MAX_MIGRATIONS,
            queue_timeout: DEFAULT_QUEUE_TIMEOUT,
            live_replan: Some(replan::ReplanPolicy::default()),
            speculative: SpeculativeConfig::OFF,
        }
    }

    /// Tokens one micro-batch may carry: an equal part of the step's budget for each of the
    /// stages' micro-batches in flight. A whole budget's prompt chunk in one micro-batch made
    /// it many times heavier than the others (128 tokens against 8 decodes at 16 streams over
    /// two stages), and every stage waited for it once a round.
    pub fn micro_batch_tokens(&self) -> usize {
        self.max_batch_tokens.div_ceil(self.stages.max(1)).max(1)
    }
}

/// A request as the scheduler sees it (its events go out through the engine).
#[derive(Debug)]
pub(crate) struct SeqRequest {
    pub id: u64,
    /// When the request was accepted (for time-to-first-token).
    pub submitted: std::time::Instant,
    pub req: GenerationRequest,
    /// The sequence's span (a child of the request's), ended when the sequence finishes.
    pub span: tracing::Span,
    /// Open while the sequence waits for admission.
    pub queue_span: tracing::Span,
    /// Since when it waits for admission (the queue timeout counts from here): its
    /// submission, or the moment its pipeline broke.
    pub queued_at: std::time::Instant,
    /// Where a sequence moved from a broken pipeline resumes; None for a new request.
    pub resume: Option<Resume>,
}

/// What a sequence had generated when its pipeline broke: on the rebuilt pipeline it is
/// prefilled again from its prompt and these tokens (no stage's KV is assumed) and continues,
/// its client seeing a pause rather than an error.
#[derive(Debug, Clone, Default)]
pub(crate) struct Resume {
    /// Tokens generated and delivered so far.
    pub generated: Vec<u32>,
    /// Moves so far, this one included.
    pub migrations: u32,
    /// The request was already told how many prompt tokens came from the prefix cache.
    pub cached_reported: bool,
    /// When its last token came (inter-token latency continues from there).
    pub last_token: Option<std::time::Instant>,
}

/// A new sequence handed to the engine: the request and where its events go.
#[derive(Debug)]
pub(crate) struct NewSequence {
    pub request: SeqRequest,
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
    /// How the current assignment's ranges were chosen.
    pub split: std::sync::Mutex<Option<split::SplitInfo>>,
    /// The running-sequence and token limits the current pipeline runs with.
    pub limits: std::sync::Mutex<Option<sizing::StepLimits>>,
    /// Tokens sampled for requests since start.
    pub generated_tokens: AtomicU64,
    /// Prompt tokens sent down the pipeline (prefill) since start.
    pub prompt_tokens: AtomicU64,
    /// Micro-batches that came back since start.
    pub steps_completed: AtomicU64,
    /// Their summed round trips (every stage plus transfers), in microseconds.
    pub step_micros: AtomicU64,
    /// Each stage's latest Health answer, in stage order, while the pipeline stands.
    pub stage_live: std::sync::Mutex<Vec<StageLive>>,
    /// When the stages' numbers were last asked for (`describe`); they are polled only then.
    pub viewed: std::sync::Mutex<Option<std::time::Instant>>,
    /// KV blocks of the pipeline (the same on every stage) and how many sequences hold.
    pub kv_blocks_total: AtomicU64,
    pub kv_blocks_used: AtomicU64,
    /// Blocks in the prefix index (held by sequences or idle and reusable).
    pub kv_blocks_cached: AtomicU64,
    /// Hybrid models: recurrent-state snapshots attached to cached blocks or being filled, and
    /// how many every stage keeps.
    pub state_snapshots_used: AtomicU64,
    pub state_snapshots: AtomicU64,
    /// Prompt tokens looked up in the prefix cache, and how many of them were reused.
    pub prefix_queried_tokens: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    /// Sequences preempted (their KV dropped, to be recomputed) because blocks ran out.
    pub preemptions: AtomicU64,
    /// A pipeline that stood broke and is being rebuilt: requests are accepted and wait (up
    /// to the queue timeout) instead of being refused.
    pub recovering: AtomicBool,
    /// Sequences moved to a rebuilt pipeline since start.
    pub migrations: AtomicU64,
    /// Pipelines rebuilt while serving (a stage lost, or workers joined a degraded one).
    pub replans: AtomicU64,
    /// Why the latest rebuild happened, for `/admin/cluster`.
    pub last_replan: std::sync::Mutex<Option<String>>,
    /// Speculative decoding since start: verify steps, tokens proposed, and tokens accepted.
    pub spec_steps: AtomicU64,
    pub spec_proposed_tokens: AtomicU64,
    pub spec_accepted_tokens: AtomicU64,
}

impl PipelineStatus {
    /// Count a micro-batch that came back after `round_trip`.
    pub fn record_step(&self, round_trip: std::time::Duration) {
        self.steps_completed.fetch_add(1, Ordering::Relaxed);
        self.step_micros
            .fetch_add(round_trip.as_micros() as u64, Ordering::Relaxed);
    }
}

/// The device of the in-process stage, for `/admin/cluster` (workers register theirs).
#[derive(Debug, Clone)]
struct LocalDevice {
    kind: &'static str,
    cores: usize,
    features: Vec<String>,
}

/// Generator backed by a pipeline: gRPC workers, or one stage in this process.
pub struct PipelineGenerator {
    config: PipelineConfig,
    /// The registry of workers; None for the in-process stage.
    cluster: Option<Arc<Cluster>>,
    local: Option<LocalDevice>,
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
            cluster: Some(cluster),
            local: None,
            submit_tx,
            next_id: AtomicU64::new(1),
            status,
        }
    }

    /// Serve on `stage`, the whole model loaded in this process (`baton serve --workers 0`,
    /// `baton generate`), with the same engine as a pipeline of workers; `reload` builds a
    /// new stage if the running one fails.
    pub fn start_local(mut config: PipelineConfig, stage: Stage, reload: StageLoader) -> Self {
        config.stages = 1;
        let info = stage.backend().info();
        let local = LocalDevice {
            kind: info.device.kind(),
            cores: info.threads,
            features: vec![format!("kernels:{}", info.kernels), format!("weights:{}", info.weights)],
        };
        let (submit_tx, submit_rx) = mpsc::channel(config.max_queue.max(1));
        let status = Arc::new(PipelineStatus::default());
        tokio::spawn(supervisor::run_local(
            config.clone(),
            stage,
            reload,
            submit_rx,
            status.clone(),
        ));
        Self {
            config,
            cluster: None,
            local: Some(local),
            submit_tx,
            next_id: AtomicU64::new(1),
            status,
        }
    }
}

impl PipelineGenerator {
    /// Wait until the pipeline is ready to take requests, at most `within`.
    pub async fn wait_ready(&self, within: std::time::Duration) -> Result<(), SubmitError> {
        let deadline = tokio::time::Instant::now() + within;
        while !self.ready() {
            if tokio::time::Instant::now() >= deadline || self.submit_tx.is_closed() {
                return Err(SubmitError::Unavailable(format!(
                    "the pipeline was not ready within {within:?}"
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        Ok(())
    }
}

impl Generator for PipelineGenerator {
    fn submit(&self, req: GenerationRequest) -> Result<mpsc::Receiver<TokenEvent>, SubmitError> {
        let recovering = self.status.recovering.load(Ordering::Acquire);
        if !self.status.ready.load(Ordering::Acquire) && !recovering {
            return Err(SubmitError::Unavailable(format!(
                "the pipeline is not ready (waiting for {} worker(s) to register and load their layers)",
                self.config.stages
            )));
        }
        req.check(self.config.vocab_size, self.config.max_context)?;
        if req.params.speculative_tokens.is_some_and(|k| k > 0)
            && self.config.speculative.method == crate::speculative::DraftMethod::Off
        {
            return Err(SubmitError::Invalid(
                "speculative_tokens: this server runs without speculative decoding (start it with --speculative ngram)"
                    .into(),
            ));
        }
        // Room for every token, `Done` and `PromptCached`, so a slow reader never loses one.
        let (tx, rx) = mpsc::channel(req.params.max_tokens.clamp(1, 4096) + 2);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let span = tracing::info_span!(
            "sequence",
            seq_id = id,
            prompt_tokens = req.prompt.len(),
            cached_tokens = tracing::field::Empty,
            max_tokens = req.params.max_tokens,
            generated_tokens = tracing::field::Empty,
            finish_reason = tracing::field::Empty,
        );
        let queue_span = tracing::info_span!(parent: &span, "queue.wait");
        self.submit_tx
            .try_send(NewSequence {
                request: SeqRequest {
                    id,
                    submitted: std::time::Instant::now(),
                    req,
                    span,
                    queue_span,
                    queued_at: std::time::Instant::now(),
                    resume: None,
                },
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
        *self.status.viewed.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
        let live = self.status.stage_live.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let split = self.status.split.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let alive = self.cluster.as_ref().map(|c| c.alive()).unwrap_or_default();
        let stages: Vec<_> = assignment
            .iter()
            .enumerate()
            .map(|(i, a)| {
                // Milliseconds of one micro-batch of each planned shape, by shape (measured plans).
                let predicted = split.as_ref().map(|s| {
                    s.stage_seconds(i)
                        .into_iter()
                        .map(|(shape, secs)| (shape.to_string(), serde_json::json!(secs * 1e3)))
                        .collect::<serde_json::Map<_, _>>()
                });
                let mut stage = serde_json::json!({
                    "stage": i, "worker_id": a.worker_id, "address": a.address,
                    "layer_start": a.layers.start, "layer_end": a.layers.end,
                    "alive": match &self.cluster {
                        Some(c) => c.is_alive(&a.worker_id),
                        None => self.ready(),
                    },
                    "live": live.get(i).map(StageLive::to_json),
                    "predicted_ms": predicted,
                });
                // Repeated from `workers` so a stage reads on its own (the dashboard's boxes).
                if let Some(w) = alive.iter().find(|w| w.id == a.worker_id) {
                    stage["device"] = w.device_kind.clone().into();
                    stage["cores"] = w.cores.into();
                    stage["memory_bytes"] = w.memory_bytes.into();
                    stage["features"] = w.features.clone().into();
                } else if let Some(d) = &self.local {
                    stage["device"] = d.kind.into();
                    stage["cores"] = d.cores.into();
                    stage["features"] = d.features.clone().into();
                }
                stage
            })
            .collect();
        let workers: Vec<_> = alive
            .into_iter()
            .map(|w| {
                serde_json::json!({
                    "worker_id": w.id, "address": w.address, "device": w.device_kind, "cores": w.cores,
                    "memory_bytes": w.memory_bytes, "features": w.features,
                    "metrics_address": (!w.metrics_address.is_empty()).then_some(&w.metrics_address),
                    "last_seen_ms_ago": w.last_seen.elapsed().as_millis() as u64,
                })
            })
            .collect();
        let limits = self.status.limits.lock().unwrap_or_else(|e| e.into_inner()).clone();
        serde_json::json!({
            "mode": if self.cluster.is_some() { "pipeline" } else { "in-process" },
            "ready": self.ready(),
            "num_layers": self.config.num_layers,
            "stages_wanted": self.config.stages,
            "stages": stages,
            "split": split.as_ref().map(split::SplitInfo::to_json),
            "workers": workers,
            "running_sequences": self.status.active_sequences.load(Ordering::Relaxed),
            "max_micro_batches_in_flight": self.status.max_in_flight.load(Ordering::Relaxed),
            "max_running": limits.as_ref().map_or(self.config.max_running, |l| l.max_running),
            "limits": limits.as_ref().map(sizing::StepLimits::to_json),
            "max_queue": self.config.max_queue,
            // Requests accepted and not yet admitted: what the submission channel holds.
            "queue_depth": self.submit_tx.max_capacity() - self.submit_tx.capacity(),
            "generated_tokens_total": self.status.generated_tokens.load(Ordering::Relaxed),
            "prompt_tokens_total": self.status.prompt_tokens.load(Ordering::Relaxed),
            "steps_completed": self.status.steps_completed.load(Ordering::Relaxed),
            "step_seconds_total": self.status.step_micros.load(Ordering::Relaxed) as f64 / 1e6,
            "kv_block_size": self.config.kv_block_size,
            "kv_blocks_total": self.status.kv_blocks_total.load(Ordering::Relaxed),
            "kv_blocks_used": self.status.kv_blocks_used.load(Ordering::Relaxed),
            "preemptions_total": self.status.preemptions.load(Ordering::Relaxed),
            "recovering": self.status.recovering.load(Ordering::Relaxed),
            "migrations_total": self.status.migrations.load(Ordering::Relaxed),
            "replans_total": self.status.replans.load(Ordering::Relaxed),
            "last_replan": self.status.last_replan.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            "prefix_cache": {
                "enabled": self.config.prefix_caching,
                "cached_blocks": self.status.kv_blocks_cached.load(Ordering::Relaxed),
                "queried_tokens_total": self.status.prefix_queried_tokens.load(Ordering::Relaxed),
                "hit_tokens_total": self.status.prefix_hit_tokens.load(Ordering::Relaxed),
                "state_snapshots": self.status.state_snapshots.load(Ordering::Relaxed),
                "state_snapshots_used": self.status.state_snapshots_used.load(Ordering::Relaxed),
            },
            "speculative": {
                "method": self.config.speculative.method.as_str(),
                "num_speculative_tokens": self.config.speculative.tokens,
                "draft_model": self.config.speculative.worker_draft(),
                "verify_steps_total": self.status.spec_steps.load(Ordering::Relaxed),
                "proposed_tokens_total": self.status.spec_proposed_tokens.load(Ordering::Relaxed),
                "accepted_tokens_total": self.status.spec_accepted_tokens.load(Ordering::Relaxed),
            },
        })
    }
}
