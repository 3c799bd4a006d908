//! An in-process coordinator (registry + pipeline generator) with real worker processes
//! (`baton worker`) on loopback, for pipeline tests.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_coordinator::generation::{FinishReason, GenerationRequest, Generator, TokenEvent};
use baton_coordinator::pipeline::sizing::AutoLimits;
use baton_coordinator::pipeline::{PipelineConfig, PipelineGenerator};
use baton_coordinator::planner::SplitPolicy;
use baton_coordinator::registry::{self, Cluster};
use baton_coordinator::speculative::SpeculativeConfig;
use baton_shared::auth::PeerAuth;
use baton_shared::grpc_limits::GrpcLimits;
use baton_shared::model_config::ModelConfig;
use baton_shared::proto::Dtype;
use baton_shared::sampling::SamplingParams;
use baton_worker::kv_cache::KvDtype;
use tokio::process::{Child, Command};

/// `baton worker`, ready for more arguments. The `baton` binary, not `baton-worker` (the same
/// worker, for slim images): `cargo test --workspace` builds `baton` for the coordinator's
/// integration tests, but nothing in it builds `baton-worker`.
pub fn worker_command() -> Command {
    let mut cmd = Command::new(crate::baton_bin());
    cmd.arg("worker");
    cmd
}

/// Admission limits of the pipeline under test.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_running: usize,
    pub max_queue: usize,
    pub max_batch_tokens: usize,
    /// Workers heartbeat this often and are dead after three missed beats. Long enough that a
    /// worker starved of CPU on a loaded 2-core machine is not declared dead: tests that kill
    /// workers wait for the death to be noticed (up to [`crate::PATIENCE`]), not for a time.
    pub heartbeat: Duration,
    /// Cap on the pipeline's KV blocks (of 16 positions); None: the workers' budgets.
    pub kv_max_blocks: Option<usize>,
    /// How the workers store keys and values.
    pub kv_dtype: KvDtype,
    /// Let the measured planner choose the ranges; the cuts then only set the stage count.
    pub measured_split: bool,
    /// Reuse cached prefix blocks.
    pub prefix_caching: bool,
    /// Moves a sequence may make to a rebuilt pipeline.
    pub max_migrations: u32,
    /// Longest wait for admission (also for a broken pipeline to be rebuilt).
    pub queue_timeout: Duration,
    /// Re-plan on measured stage times (off by default: tests want the split they asked for).
    pub live_replan: Option<baton_coordinator::pipeline::replan::ReplanPolicy>,
    /// Pin worker `i` to CPU core `i` (with `taskset`), so a test can load one worker's core.
    pub pin_cores: bool,
    /// Limits sized from the workers' profiles instead of the values above.
    pub auto_limits: AutoLimits,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_running: 8,
            max_queue: 64,
            max_batch_tokens: 512,
            heartbeat: Duration::from_secs(2),
            kv_max_blocks: None,
            kv_dtype: KvDtype::F32,
            measured_split: false,
            prefix_caching: true,
            max_migrations: 3,
            queue_timeout: Duration::from_secs(120),
            live_replan: None,
            pin_cores: false,
            auto_limits: AutoLimits::NONE,
        }
    }
}

/// TLS files of a test cluster: the coordinator's identity and one shared by the workers.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub ca: std::path::PathBuf,
    pub coordinator: (std::path::PathBuf, std::path::PathBuf),
    pub worker: (std::path::PathBuf, std::path::PathBuf),
}

impl TlsFiles {
    /// Environment that gives a worker process its TLS identity.
    fn worker_env(&self) -> [(&'static str, &Path); 3] {
        [
            ("BATON_TLS_CERT", &self.worker.0),
            ("BATON_TLS_KEY", &self.worker.1),
            ("BATON_TLS_CA", &self.ca),
        ]
    }

    /// The coordinator's credentials with `token`.
    pub fn coordinator_peer(&self, token: &str) -> PeerAuth {
        let tls = baton_shared::tls::ClusterTls::load(&self.coordinator.0, &self.coordinator.1, &self.ca)
            .expect("loading the coordinator's TLS files");
        PeerAuth::with_tls(token, tls)
    }
}

/// A running test cluster; workers are killed when it is dropped.
pub struct TestCluster {
    pub generator: Arc<PipelineGenerator>,
    pub cluster: Arc<Cluster>,
    pub registry_url: String,
    pub token: String,
    /// The coordinator's worker-plane credentials.
    pub peer: PeerAuth,
    pub workers: Vec<Child>,
}

/// Start a worker process that registers at `registry_url`.
pub fn spawn_worker(registry_url: &str, token: &str) -> Child {
    spawn_worker_with(registry_url, token, &[])
}

/// Start a worker process with extra flags.
pub fn spawn_worker_with(registry_url: &str, token: &str, extra: &[String]) -> Child {
    start_worker(worker_command(), registry_url, token, extra)
}

/// Start a worker process on CPU core `core` only (`taskset`), with one thread.
pub fn spawn_worker_pinned(registry_url: &str, token: &str, core: usize, extra: &[String]) -> Child {
    start_worker(pinned_command(core), registry_url, token, extra)
}

fn pinned_command(core: usize) -> Command {
    let mut cmd = Command::new("taskset");
    cmd.args(["-c", &core.to_string()])
        .arg(crate::baton_bin())
        .args(["worker", "--device", "cpu:1"]);
    cmd
}

/// Wait until `cluster` has a live worker, or panic naming `what` after the tests' patience.
pub async fn wait_for_a_worker(cluster: &Cluster, what: &str) {
    crate::wait_until_async(what, || async {
        if cluster.alive().is_empty() {
            Err("no worker alive".into())
        } else {
            Ok(())
        }
    })
    .await;
}

/// Start the worker `cmd` (e.g. [`worker_command`] with extra environment) that registers at
/// `registry_url`.
pub fn spawn_worker_from(cmd: Command, registry_url: &str, token: &str, extra: &[String]) -> Child {
    start_worker(cmd, registry_url, token, extra)
}

fn start_worker(cmd: Command, registry_url: &str, token: &str, extra: &[String]) -> Child {
    start_worker_in(cmd, registry_url, token, extra, None)
}

fn start_worker_in(
    mut cmd: Command,
    registry_url: &str,
    token: &str,
    extra: &[String],
    tls: Option<&TlsFiles>,
) -> Child {
    if let Some(tls) = tls {
        cmd.envs(tls.worker_env());
    }
    cmd.args(["--listen", "127.0.0.1:0", "--coordinator", registry_url])
        .args(extra)
        .env("BATON_CLUSTER_TOKEN", token)
        .env("BATON_LOG_LEVEL", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("starting baton worker")
}

/// Generate on `generator` and collect every token; Err carries a `Failed` event's message.
pub async fn generate_on(
    generator: &impl Generator,
    prompt: &[u32],
    params: SamplingParams,
) -> Result<(Vec<u32>, FinishReason), String> {
    let req = GenerationRequest {
        prompt: prompt.to_vec(),
        params,
        top_logprobs: 0,
        logprobs: false,
    };
    let mut rx = generator.submit(req).map_err(|e| e.to_string())?;
    let mut tokens = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            TokenEvent::PromptCached { .. } => {}
            TokenEvent::Token { id, .. } => tokens.push(id),
            TokenEvent::Done { reason } => return Ok((tokens, reason)),
            TokenEvent::Failed { message, .. } => return Err(message),
        }
    }
    Err("event stream ended without Done".into())
}

impl TestCluster {
    /// Registry + pipeline over `model`, split at `cuts` (empty: one stage), with as many workers.
    pub async fn start(model: &Path, cfg: &ModelConfig, eos_ids: Vec<u32>, cuts: &[usize]) -> Self {
        Self::start_with(model, cfg, eos_ids, cuts, &[]).await
    }

    /// Like [`TestCluster::start`], with extra flags for each worker (by index).
    pub async fn start_with(
        model: &Path,
        cfg: &ModelConfig,
        eos_ids: Vec<u32>,
        cuts: &[usize],
        worker_flags: &[Vec<String>],
    ) -> Self {
        Self::start_full(model, cfg, eos_ids, cuts, worker_flags, Limits::default()).await
    }

    /// A cluster whose workers serve Prometheus metrics; returns it and the workers' metrics
    /// addresses (host:port, in registration order, which need not be stage order).
    pub async fn start_with_worker_metrics(model: &Path, cfg: &ModelConfig, cuts: &[usize]) -> (Self, Vec<String>) {
        // Port 0: each worker binds a free port and registers it, so no port is reserved here
        // and then lost to another socket before the worker binds it.
        let flags = vec![vec!["--metrics-listen".to_string(), "127.0.0.1:0".to_string()]; cuts.len() + 1];
        let tc = Self::start_with(model, cfg, vec![], cuts, &flags).await;
        let addresses: Vec<String> = tc.cluster.alive().into_iter().map(|w| w.metrics_address).collect();
        assert_eq!(addresses.len(), cuts.len() + 1, "every worker registered");
        assert!(
            addresses
                .iter()
                .all(|a| a.starts_with("127.0.0.1:") && !a.ends_with(":0")),
            "every worker registers the metrics port it bound: {addresses:?}"
        );
        (tc, addresses)
    }

    /// Everything configurable.
    pub async fn start_full(
        model: &Path,
        cfg: &ModelConfig,
        eos_ids: Vec<u32>,
        cuts: &[usize],
        worker_flags: &[Vec<String>],
        limits: Limits,
    ) -> Self {
        Self::start_secured(
            model,
            cfg,
            eos_ids,
            cuts,
            worker_flags,
            limits,
            None,
            SpeculativeConfig::OFF,
        )
        .await
    }

    /// A cluster whose decode steps carry proposals from `speculative`'s drafter.
    pub async fn start_speculative(
        model: &Path,
        cfg: &ModelConfig,
        eos_ids: Vec<u32>,
        cuts: &[usize],
        limits: Limits,
        speculative: SpeculativeConfig,
    ) -> Self {
        // Workers serve metrics (on ports they pick), so tests can read what each stage counted.
        let flags = vec![vec!["--metrics-listen".to_string(), "127.0.0.1:0".to_string()]; cuts.len() + 1];
        Self::start_secured(model, cfg, eos_ids, cuts, &flags, limits, None, speculative).await
    }

    /// A cluster whose worker plane runs mutual TLS with `tls`'s certificates.
    pub async fn start_tls(model: &Path, cfg: &ModelConfig, cuts: &[usize], tls: &TlsFiles) -> Self {
        Self::start_secured(
            model,
            cfg,
            vec![],
            cuts,
            &[],
            Limits::default(),
            Some(tls),
            SpeculativeConfig::OFF,
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn start_secured(
        model: &Path,
        cfg: &ModelConfig,
        eos_ids: Vec<u32>,
        cuts: &[usize],
        worker_flags: &[Vec<String>],
        limits: Limits,
        tls: Option<&TlsFiles>,
        speculative: SpeculativeConfig,
    ) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let token = "test-cluster-token".to_string();
        let peer = match tls {
            Some(files) => files.coordinator_peer(&token),
            None => PeerAuth::plaintext(token.clone()),
        };
        let registry_url = format!("{}://{}", peer.scheme(), listener.local_addr().unwrap());
        let cluster = Arc::new(Cluster::new(limits.heartbeat));
        let (c, p) = (cluster.clone(), peer.clone());
        tokio::spawn(
            async move { registry::serve(listener, c, &p, &GrpcLimits::default(), std::future::pending()).await },
        );
        let stages = cuts.len() + 1;
        let config = PipelineConfig {
            model: model.display().to_string(),
            num_layers: cfg.num_layers,
            layer_table: baton_coordinator::pipeline::layer_table(cfg),
            vocab_size: cfg.vocab_size,
            max_context: cfg.max_position_embeddings,
            eos_ids,
            stages,
            cuts: (!cuts.is_empty() && !limits.measured_split).then(|| cuts.to_vec()),
            split: SplitPolicy::Measured,
            peer: peer.clone(),
            activation_dtype: Dtype::F32,
            max_queue: limits.max_queue,
            max_running: limits.max_running,
            max_batch_tokens: limits.max_batch_tokens,
            auto_limits: limits.auto_limits,
            weights: "f32".into(),
            kv_dim: cfg.kv_dim(),
            layer_caches: baton_coordinator::pipeline::layer_caches(cfg),
            kv_block_size: 16,
            kv_max_blocks: limits.kv_max_blocks,
            kv_dtype: limits.kv_dtype,
            prefix_caching: limits.prefix_caching,
            recurrent_state: cfg.linear_attention.is_some(),
            state_snapshots: match cfg.linear_attention {
                Some(_) => baton_shared::settings::DEFAULT_STATE_SNAPSHOTS,
                None => 0,
            },
            max_migrations: limits.max_migrations,
            queue_timeout: limits.queue_timeout,
            live_replan: limits.live_replan,
            speculative,
        };
        let generator = Arc::new(PipelineGenerator::start(config, cluster.clone()));
        let mut workers = Vec::with_capacity(stages);
        for i in 0..stages {
            let flags = worker_flags.get(i).map_or(&[][..], Vec::as_slice);
            if limits.pin_cores {
                workers.push(start_worker_in(pinned_command(i), &registry_url, &token, flags, tls));
                // One at a time, so stage i is worker i on core i (stages follow registration).
                let start = Instant::now();
                while cluster.alive().len() <= i {
                    assert!(start.elapsed() < crate::PATIENCE, "worker {i} did not register");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            } else {
                workers.push(start_worker_in(worker_command(), &registry_url, &token, flags, tls));
            }
        }
        let mut tc = Self {
            generator,
            cluster,
            registry_url,
            token,
            peer,
            workers,
        };
        tc.wait_ready(2 * crate::PATIENCE).await;
        tc
    }

    /// Wait until the pipeline is ready, or panic: at once when a worker process has exited
    /// (its stderr, inherited, says why), else after `limit`.
    pub async fn wait_ready(&mut self, limit: Duration) {
        let start = Instant::now();
        while !self.generator.ready() {
            for (i, w) in self.workers.iter_mut().enumerate() {
                if let Ok(Some(status)) = w.try_wait() {
                    panic!("worker {i} exited ({status}) before the pipeline was ready");
                }
            }
            assert!(start.elapsed() < limit, "pipeline not ready after {limit:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Generate and collect every token; Err carries a `Failed` event's message.
    pub async fn generate(&self, prompt: &[u32], params: SamplingParams) -> Result<(Vec<u32>, FinishReason), String> {
        generate_on(&*self.generator, prompt, params).await
    }

    /// Sequences each stage holds KV for, in stage order (asked over gRPC Health).
    pub async fn stage_sequences(&self) -> Vec<u32> {
        let assignment = self.generator.status.assignment.lock().unwrap().clone();
        let mut out = Vec::new();
        for a in assignment {
            let channel = self
                .peer
                .endpoint(&a.address)
                .expect("worker address")
                .connect()
                .await
                .expect("connecting to a worker");
            let auth = baton_shared::auth::AddToken::new(&self.token).expect("token");
            let mut client = baton_shared::proto::worker_client::WorkerClient::with_interceptor(channel, auth);
            let health = client
                .health(baton_shared::proto::HealthRequest {})
                .await
                .expect("health");
            out.push(health.into_inner().active_sequences);
        }
        out
    }
}
