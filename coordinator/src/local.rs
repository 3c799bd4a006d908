//! In-process token generation: the whole model on one dedicated OS thread, serving a bounded
//! queue of requests and interleaving the active sequences token by token, so concurrent
//! requests all make progress.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError, sync_channel};
use std::thread::JoinHandle;

use baton_shared::sampling::SamplingParams;
use baton_worker::kv_cache::SequenceKv;
use baton_worker::model::{ForwardError, Scratch, StageWeights};
use baton_worker::sampler::{Sampler, log_softmax_top};
use tokio::sync::mpsc;

use crate::generation::{GenerationRequest, Generator, SubmitError, TokenEvent, TokenLogprobs};

/// Queue and concurrency limits.
#[derive(Debug, Clone, Copy)]
pub struct LocalConfig {
    /// Requests waiting to start; beyond this `submit` answers `Overloaded` (HTTP 429).
    pub max_queue: usize,
    /// Sequences generating at once (round-robin, one token each per turn).
    pub max_running: usize,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            max_queue: 64,
            max_running: 8,
        }
    }
}

/// Why a local generator could not start.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("the local generator needs the whole model (embedding, every layer and the head)")]
    NotFullModel,
    #[error("max_queue and max_running must be at least 1")]
    ZeroLimit,
    #[error("starting the engine thread: {0}")]
    Spawn(#[from] std::io::Error),
}

/// A [`Generator`] running the fp32 reference model in this process.
pub struct LocalGenerator {
    queue: SyncSender<Admitted>,
    alive: Arc<AtomicBool>,
    vocab_size: usize,
    max_context: usize,
    max_queue: usize,
    max_running: usize,
    load: Arc<LocalLoad>,
    /// What does not change: the model's shape and the hardware, for `/admin/cluster`.
    stage_info: serde_json::Value,
    _thread: JoinHandle<()>,
}

/// What the engine thread is doing, for `/admin/cluster` (the one stage of the dashboard).
#[derive(Debug, Default)]
struct LocalLoad {
    /// Accepted by `submit`, not yet taken by the engine thread.
    queued: AtomicU64,
    running: AtomicU64,
    kv_tokens: AtomicU64,
    kv_capacity_tokens: AtomicU64,
    kv_bytes: AtomicU64,
    generated_tokens: AtomicU64,
    prompt_tokens: AtomicU64,
    forward_batches: AtomicU64,
    forward_tokens: AtomicU64,
    forward_micros: AtomicU64,
}

/// A request handed to the engine thread with the channel for its events.
struct Admitted {
    req: GenerationRequest,
    tx: mpsc::Sender<TokenEvent>,
}

impl LocalGenerator {
    /// Start the engine thread over full-model `weights`; `eos_ids` end generation unless a
    /// request sets `ignore_eos`.
    pub fn new(weights: StageWeights, eos_ids: Vec<u32>, config: LocalConfig) -> Result<Self, LocalError> {
        let full = weights.is_first
            && weights.is_last
            && weights.layers.start == 0
            && weights.layers.end == weights.config.num_layers;
        if !full {
            return Err(LocalError::NotFullModel);
        }
        if config.max_queue == 0 || config.max_running == 0 {
            return Err(LocalError::ZeroLimit);
        }
        let vocab_size = weights.config.vocab_size;
        let max_context = weights.config.max_position_embeddings;
        let stage_info = serde_json::json!({
            "stage": 0, "worker_id": "local", "address": "in-process",
            "layer_start": 0, "layer_end": weights.config.num_layers,
            "device": "cpu", "cores": weights.pool.threads(),
            "features": [format!("kernels:{}", weights.kernels.path().name()), format!("weights:{}", weights.format)],
        });
        let (queue, requests) = sync_channel(config.max_queue);
        let alive = Arc::new(AtomicBool::new(true));
        let load = Arc::new(LocalLoad::default());
        let engine = Engine {
            load: load.clone(),
            weights,
            scratch: Scratch::default(),
            hidden: Vec::new(),
            logits: vec![0.0; vocab_size],
            eos_ids,
        };
        let flag = AliveGuard(alive.clone());
        let thread = std::thread::Builder::new()
            .name("baton-local-engine".into())
            .spawn(move || {
                let _flag = flag;
                engine.run(requests, config.max_running);
            })?;
        Ok(Self {
            queue,
            alive,
            vocab_size,
            max_context,
            max_queue: config.max_queue,
            max_running: config.max_running,
            load,
            stage_info,
            _thread: thread,
        })
    }
}

impl Generator for LocalGenerator {
    fn submit(&self, req: GenerationRequest) -> Result<mpsc::Receiver<TokenEvent>, SubmitError> {
        if !self.ready() {
            return Err(SubmitError::Unavailable("the local engine has stopped".into()));
        }
        req.check(self.vocab_size, self.max_context)?;
        // Room for every token and the final event, so the engine thread never blocks on a
        // slow client (tokio allocates channel slots lazily, so this reserves nothing).
        let (tx, rx) = mpsc::channel(req.params.max_tokens + 1);
        // Counted before sending, so the engine thread's decrement cannot come first.
        self.load.queued.fetch_add(1, Ordering::Relaxed);
        let sent = self.queue.try_send(Admitted { req, tx });
        if sent.is_err() {
            self.load.queued.fetch_sub(1, Ordering::Relaxed);
        }
        match sent {
            Ok(()) => Ok(rx),
            Err(TrySendError::Full(_)) => Err(SubmitError::Overloaded(format!(
                "{} requests are already waiting; retry later",
                self.max_queue
            ))),
            Err(TrySendError::Disconnected(_)) => Err(SubmitError::Unavailable("the local engine has stopped".into())),
        }
    }

    fn ready(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    fn describe(&self) -> serde_json::Value {
        let l = &*self.load;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut stage = self.stage_info.clone();
        stage["alive"] = self.ready().into();
        // The same shape as a pipeline stage's Health-derived numbers.
        stage["live"] = serde_json::json!({
            "answered": true, "answered_ms_ago": 0, "error": null, "loaded": true,
            "sequences": get(&l.running), "kv_tokens": get(&l.kv_tokens),
            "kv_capacity_tokens": get(&l.kv_capacity_tokens), "kv_bytes": get(&l.kv_bytes),
            "forward_batches": get(&l.forward_batches), "forward_tokens": get(&l.forward_tokens),
            "forward_seconds": get(&l.forward_micros) as f64 / 1e6,
        });
        serde_json::json!({
            "mode": "in-process",
            "ready": self.ready(),
            "max_queue": self.max_queue,
            "max_running": self.max_running,
            "num_layers": self.stage_info["layer_end"],
            "stages": [stage],
            "workers": [],
            "running_sequences": get(&l.running),
            "queue_depth": get(&l.queued),
            "generated_tokens_total": get(&l.generated_tokens),
            "prompt_tokens_total": get(&l.prompt_tokens),
        })
    }
}

/// Clears the liveness flag when the engine thread ends, however it ends.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// One sequence being generated.
struct Sequence {
    tx: mpsc::Sender<TokenEvent>,
    kv: SequenceKv,
    sampler: Sampler,
    /// The prompt until it has been prefilled, then empty.
    prompt: Vec<u32>,
    /// The last sampled token, forwarded on the next turn.
    last: u32,
    generated: usize,
    /// Stop conditions (and the settings the sampler was made from).
    params: SamplingParams,
    logprobs: bool,
    top_logprobs: usize,
}

/// The engine thread's model and reusable buffers.
struct Engine {
    load: Arc<LocalLoad>,
    weights: StageWeights,
    scratch: Scratch,
    hidden: Vec<f32>,
    logits: Vec<f32>,
    eos_ids: Vec<u32>,
}

/// KV rows reserved up front beyond the prompt; the cache doubles when a sequence outgrows it,
/// so a request asking for the whole context does not pin memory it may never use.
const INITIAL_KV_HEADROOM: usize = 256;

impl Engine {
    fn run(mut self, requests: Receiver<Admitted>, max_running: usize) {
        let mut active: VecDeque<Sequence> = VecDeque::new();
        let mut open = true;
        loop {
            while open && active.len() < max_running {
                // Block only when there is nothing else to do.
                let next = if active.is_empty() {
                    requests.recv().map_err(|_| TryRecvError::Disconnected)
                } else {
                    requests.try_recv()
                };
                match next {
                    Ok(a) => {
                        self.load.queued.fetch_sub(1, Ordering::Relaxed);
                        active.push_back(self.admit(a));
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            if active.is_empty() {
                if open {
                    continue;
                }
                tracing::debug!("local engine: generator dropped, thread exiting");
                return;
            }
            // One turn: every active sequence advances by one token.
            active.retain_mut(|seq| self.turn(seq));
            self.record_usage(&active);
        }
    }

    /// Publish what the running sequences hold (a handful: at most `max_running`).
    fn record_usage(&self, active: &VecDeque<Sequence>) {
        let (mut used, mut capacity, mut bytes) = (0, 0, 0);
        for s in active {
            used += s.kv.len();
            capacity += s.kv.capacity();
            bytes += s.kv.bytes();
        }
        let l = &self.load;
        l.running.store(active.len() as u64, Ordering::Relaxed);
        l.kv_tokens.store(used as u64, Ordering::Relaxed);
        l.kv_capacity_tokens.store(capacity as u64, Ordering::Relaxed);
        l.kv_bytes.store(bytes as u64, Ordering::Relaxed);
    }

    fn admit(&self, a: Admitted) -> Sequence {
        let c = &self.weights.config;
        let p = &a.req.params;
        let capacity = (a.req.prompt.len() + p.max_tokens.min(INITIAL_KV_HEADROOM)).min(c.max_position_embeddings);
        Sequence {
            kv: SequenceKv::new(c.num_layers, c.kv_dim(), capacity),
            sampler: Sampler::new(p),
            last: 0,
            generated: 0,
            params: p.clone(),
            logprobs: a.req.logprobs,
            top_logprobs: a.req.top_logprobs.min(c.vocab_size),
            prompt: a.req.prompt,
            tx: a.tx,
        }
    }

    /// Advance `seq` by one token; false when it is finished, failed or cancelled.
    fn turn(&mut self, seq: &mut Sequence) -> bool {
        // A dropped receiver means the client went away or a stop string matched.
        if seq.tx.is_closed() {
            return false;
        }
        match catch_unwind(AssertUnwindSafe(|| self.step(seq))) {
            Ok(Ok(keep)) => keep,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "local engine: forward pass failed");
                let _ = seq.tx.try_send(TokenEvent::Failed {
                    message: e.to_string(),
                    retriable: false,
                });
                false
            }
            Err(_) => {
                // The buffers are only resized scratch, so the thread can serve others.
                tracing::error!("local engine: a step panicked; failing its request");
                let _ = seq.tx.try_send(TokenEvent::Failed {
                    message: "internal error in the engine".into(),
                    retriable: false,
                });
                false
            }
        }
    }

    fn step(&mut self, seq: &mut Sequence) -> Result<bool, ForwardError> {
        let h = self.weights.config.hidden_size;
        let max_context = self.weights.config.max_position_embeddings;
        // Prefill the prompt on the first turn, then feed back one token per turn.
        let pos0 = seq.kv.len();
        let prompt = std::mem::take(&mut seq.prompt);
        let input: &[u32] = if pos0 == 0 {
            &prompt
        } else {
            std::slice::from_ref(&seq.last)
        };
        let rows = input.len() * h;
        if self.hidden.len() < rows {
            self.hidden.resize(rows, 0.0);
        }
        let hidden = &mut self.hidden[..rows];
        let started = std::time::Instant::now();
        self.weights.embed(input, hidden)?;
        self.weights.forward(hidden, pos0, &mut seq.kv, &mut self.scratch)?;
        self.weights
            .logits(&hidden[rows - h..], &mut self.scratch, &mut self.logits)?;
        let l = &self.load;
        l.forward_micros
            .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        l.forward_batches.fetch_add(1, Ordering::Relaxed);
        l.forward_tokens.fetch_add(input.len() as u64, Ordering::Relaxed);
        if pos0 == 0 {
            l.prompt_tokens.fetch_add(input.len() as u64, Ordering::Relaxed);
        }
        l.generated_tokens.fetch_add(1, Ordering::Relaxed);

        let id = seq.sampler.sample(&self.logits);
        seq.generated += 1;
        let logprobs = seq.logprobs.then(|| self.logprobs(id, seq.top_logprobs));
        if seq.tx.try_send(TokenEvent::Token { id, logprobs }).is_err() {
            return Ok(false);
        }
        // The sampled token is not in the KV yet: the sequence is one longer than what it holds.
        let seq_len = seq.kv.len() + 1;
        let reason = seq
            .params
            .finish_reason(id, self.eos_ids.contains(&id), seq.generated, seq_len, max_context);
        if let Some(reason) = reason {
            let _ = seq.tx.try_send(TokenEvent::Done { reason });
            return Ok(false);
        }
        seq.last = id;
        Ok(true)
    }

    /// Log-probabilities of the current logits at `id`, and the `top` most likely tokens.
    fn logprobs(&self, id: u32, top: usize) -> TokenLogprobs {
        let (logprob, top) = log_softmax_top(&self.logits, id, top);
        TokenLogprobs { logprob, top }
    }
}
