//! No request lost: a worker killed (or frozen) in the middle of 16 concurrent greedy streams,
//! with real worker processes on loopback. Every stream completes with exactly the tokens one
//! process generates, whether a standby worker takes the dead one's place, the pipeline
//! shrinks to the workers left and grows back when one joins, or it waits for a replacement.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use baton_coordinator::generation::{GenerationRequest, Generator, TokenEvent};
use baton_coordinator::pipeline::PipelineGenerator;
use baton_shared::model_files::ModelFiles;
use baton_shared::sampling::SamplingParams;
use baton_tests::cluster::{Limits, TestCluster, spawn_worker};
use baton_tests::{PATIENCE, fixtures, wait_until_async};
use baton_worker::engine::Engine;
use baton_worker::model::StageWeights;

/// 16 prompts of 1 to 136 tokens (the long ones are still being prefilled, a small chunk per
/// step, when the first streams decode), 100 greedy tokens each, and what one process
/// generates for each.
struct Workload {
    prompts: Vec<Vec<u32>>,
    params: SamplingParams,
    want: Vec<Vec<u32>>,
}

fn workload(model: &std::path::Path) -> Workload {
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(100)
    };
    let prompts: Vec<Vec<u32>> = (0..16usize)
        .map(|i| (0..1 + i * 9).map(|j| ((i * 31 + j * 7) % 300 + 3) as u32).collect())
        .collect();
    let files = ModelFiles::open(model).unwrap();
    let cfg = files.config().unwrap();
    let mut engine = Engine::new(StageWeights::load_full(&files, &cfg, true).unwrap());
    let want = prompts
        .iter()
        .map(|p| engine.generate(p, &params, None, |_| {}).unwrap().tokens)
        .collect();
    Workload { prompts, params, want }
}

/// A fixture model (its path under the fixtures), its config and its workload.
fn tiny(name: &str) -> (std::path::PathBuf, baton_shared::model_config::ModelConfig, Workload) {
    let dir = fixtures().join(name);
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let w = workload(&dir);
    (dir, cfg, w)
}

/// Limits that keep the 16 streams busy for many steps: 8 running, 16 prompt tokens a step.
fn busy_limits() -> Limits {
    Limits {
        max_running: 8,
        max_batch_tokens: 16,
        ..Limits::default()
    }
}

/// How the streams ended: each one's tokens, or its failure.
type Outcomes = Vec<Result<Vec<u32>, String>>;

/// Submit every prompt at once; once `after` tokens have arrived in all, run `disrupt`; wait
/// for every stream to end. Also returns how many streams had finished when `disrupt` ran.
async fn run_through<F: std::future::Future<Output = ()>>(
    generator: &Arc<PipelineGenerator>,
    w: &Workload,
    after: usize,
    disrupt: impl FnOnce() -> F,
) -> (Outcomes, usize) {
    let received = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(AtomicUsize::new(0));
    let streams: Vec<_> = w
        .prompts
        .iter()
        .map(|prompt| {
            let mut rx = generator
                .submit(GenerationRequest {
                    prompt: prompt.clone(),
                    params: w.params.clone(),
                    top_logprobs: 0,
                    logprobs: false,
                })
                .expect("the pipeline accepts the request");
            let (received, finished) = (received.clone(), finished.clone());
            tokio::spawn(async move {
                let mut tokens = Vec::new();
                let end = loop {
                    match rx.recv().await {
                        Some(TokenEvent::Token { id, .. }) => {
                            tokens.push(id);
                            received.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(TokenEvent::PromptCached { .. }) => {}
                        Some(TokenEvent::Done { .. }) => break Ok(tokens),
                        Some(TokenEvent::Failed { message, retriable }) => {
                            break Err(format!("failed (retriable: {retriable}): {message}"));
                        }
                        None => break Err("the stream ended without Done".into()),
                    }
                };
                finished.fetch_add(1, Ordering::Relaxed);
                end
            })
        })
        .collect();
    let start = Instant::now();
    while received.load(Ordering::Relaxed) < after {
        assert!(start.elapsed() < PATIENCE, "no tokens arrived");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let finished_before = finished.load(Ordering::Relaxed);
    let disrupted = Instant::now();
    disrupt().await;
    let mut outcomes = Vec::new();
    for s in streams {
        let end = tokio::time::timeout(4 * PATIENCE, s)
            .await
            .expect("a stream neither ended nor failed")
            .unwrap();
        outcomes.push(end);
    }
    // How long recovery took is for the machine to say; it is reported, not bounded.
    eprintln!("every stream ended {:?} after the disruption", disrupted.elapsed());
    (outcomes, finished_before)
}

/// Every stream completed with the tokens one process generates.
fn assert_all_equal(outcomes: &Outcomes, w: &Workload) {
    for (i, (got, want)) in outcomes.iter().zip(&w.want).enumerate() {
        match got {
            Ok(tokens) => assert_eq!(tokens, want, "stream {i} (prompt of {} tokens)", w.prompts[i].len()),
            Err(e) => panic!("stream {i} was lost: {e}"),
        }
    }
}

/// A disruption in the middle: some streams done, most not.
fn assert_mid_run(finished_before: usize) {
    assert!(
        finished_before < 8,
        "the disruption came too late to test anything ({finished_before} of 16 streams had finished)"
    );
}

fn kill(child: &tokio::process::Child, signal: &str) {
    let pid = child.id().expect("the worker runs").to_string();
    let ok = std::process::Command::new("kill")
        .args([signal, &pid])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {signal} {pid}");
}

async fn wait_alive(tc: &TestCluster, n: usize) {
    wait_until_async(&format!("{n} workers are alive"), || async {
        let alive = tc.cluster.alive().len();
        if alive == n {
            Ok(())
        } else {
            Err(format!("{alive} alive"))
        }
    })
    .await;
}

fn stages(tc: &TestCluster) -> usize {
    tc.generator.status.assignment.lock().unwrap().len()
}

/// Wait until the pipeline is ready with `n` stages.
async fn wait_stages(tc: &TestCluster, n: usize) {
    wait_until_async(&format!("the pipeline is ready with {n} stages"), || async {
        if tc.generator.ready() && stages(tc) == n {
            Ok(())
        } else {
            Err(format!("{} stages, ready: {}", stages(tc), tc.generator.ready()))
        }
    })
    .await;
}

fn counter(tc: &TestCluster, what: fn(&baton_coordinator::pipeline::PipelineStatus) -> &AtomicU64) -> u64 {
    what(&tc.generator.status).load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_stage_is_replaced_by_a_standby_and_no_stream_is_lost() {
    let (dir, cfg, w) = tiny("tiny/llama_tied");
    let mut tc = TestCluster::start_full(&dir, &cfg, vec![], &[1], &[], busy_limits()).await;
    tc.workers.push(spawn_worker(&tc.registry_url, &tc.token));
    wait_alive(&tc, 3).await;
    let victim = tc.workers.remove(1);
    let (outcomes, finished) = run_through(&tc.generator, &w, 40, || async { kill(&victim, "-KILL") }).await;
    assert_mid_run(finished);
    assert_all_equal(&outcomes, &w);
    assert_eq!(counter(&tc, |s| &s.replans), 1);
    assert!(counter(&tc, |s| &s.migrations) > 0, "sequences moved");
    assert_eq!(stages(&tc), 2, "the standby took the dead stage's place");
    drop(victim);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_stage_pipeline_shrinks_when_a_worker_dies_and_grows_back_when_one_joins() {
    let (dir, cfg, w) = tiny("tiny/llama_untied");
    // The planner chooses the ranges (no explicit cuts), so the pipeline may change shape.
    let limits = Limits {
        measured_split: true,
        ..busy_limits()
    };
    let mut tc = TestCluster::start_full(&dir, &cfg, vec![], &[1, 2], &[], limits).await;
    assert_eq!(stages(&tc), 3);
    let victim = tc.workers.remove(1);
    let generator = tc.generator.clone();
    let (outcomes, finished) = run_through(&generator, &w, 40, || async {
        kill(&victim, "-KILL");
        // Rebuilt on the two workers left.
        wait_stages(&tc, 2).await;
        // A replacement joins while the streams run: the pipeline grows back to three stages.
        tc.workers.push(spawn_worker(&tc.registry_url, &tc.token));
    })
    .await;
    assert_mid_run(finished);
    assert_all_equal(&outcomes, &w);
    wait_stages(&tc, 3).await;
    assert_eq!(
        counter(&tc, |s| &s.replans),
        2,
        "one rebuild for the loss, one for the join"
    );
    let last = tc.generator.status.last_replan.lock().unwrap().clone().unwrap();
    assert!(last.starts_with("workers_joined"), "{last}");
    // The grown pipeline computes what one process does.
    let (tokens, _) = tc.generate(&w.prompts[5], w.params.clone()).await.unwrap();
    assert_eq!(tokens, w.want[5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fixed_cuts_requests_wait_for_a_replacement_worker() {
    let (dir, cfg, w) = tiny("tiny/qwen3");
    let mut tc = TestCluster::start_full(&dir, &cfg, vec![], &[1], &[], busy_limits()).await;
    let victim = tc.workers.remove(0);
    let generator = tc.generator.clone();
    let mut late = None;
    let (outcomes, finished) = run_through(&generator, &w, 40, || async {
        kill(&victim, "-KILL");
        wait_until_async("the pipeline is down", || async {
            if tc.generator.ready() {
                Err("still ready".into())
            } else {
                Ok(())
            }
        })
        .await;
        // The cuts fix two stages and one worker is left: nothing is built, but a request
        // submitted now is queued rather than refused.
        late = Some(
            tc.generator
                .submit(GenerationRequest {
                    prompt: w.prompts[3].clone(),
                    params: w.params.clone(),
                    top_logprobs: 0,
                    logprobs: false,
                })
                .expect("a recovering pipeline queues new requests"),
        );
        tc.workers.push(spawn_worker(&tc.registry_url, &tc.token));
    })
    .await;
    assert_mid_run(finished);
    assert_all_equal(&outcomes, &w);
    let mut rx = late.unwrap();
    let mut tokens = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            TokenEvent::Token { id, .. } => tokens.push(id),
            TokenEvent::PromptCached { .. } => {}
            TokenEvent::Done { .. } => break,
            TokenEvent::Failed { message, .. } => panic!("{message}"),
        }
    }
    assert_eq!(tokens, w.want[3], "the request queued during recovery");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_is_detected_by_heartbeat_and_corrupts_nothing_when_it_thaws() {
    let (dir, cfg, w) = tiny("tiny/llama_tied");
    let limits = Limits {
        // Dead after three missed beats: 3 s.
        heartbeat: Duration::from_secs(1),
        ..busy_limits()
    };
    let mut tc = TestCluster::start_full(&dir, &cfg, vec![], &[1], &[], limits).await;
    tc.workers.push(spawn_worker(&tc.registry_url, &tc.token));
    wait_alive(&tc, 3).await;
    let frozen = tc.workers.remove(1);
    let (outcomes, finished) = run_through(&tc.generator, &w, 40, || async { kill(&frozen, "-STOP") }).await;
    assert_mid_run(finished);
    assert_all_equal(&outcomes, &w);
    let last = tc.generator.status.last_replan.lock().unwrap().clone().unwrap();
    assert!(last.contains("stopped heartbeating"), "{last}");
    // Thawed, it finds the coordinator forgot it and registers again; whatever it still had
    // queued from the old pipeline is dropped, not run on a new stage.
    kill(&frozen, "-CONT");
    wait_alive(&tc, 3).await;
    // Kill the other original stage: the pipeline is rebuilt on the standby and the thawed
    // worker, which must compute exactly what one process does.
    let other = tc.workers.remove(0);
    let (outcomes, _) = run_through(&tc.generator, &w, 40, || async { kill(&other, "-KILL") }).await;
    assert_all_equal(&outcomes, &w);
    assert_eq!(tc.cluster.alive().len(), 2);
    assert_eq!(stages(&tc), 2);
    drop((frozen, other));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_migration_limit_a_request_fails_with_a_retriable_error() {
    let (dir, cfg, w) = tiny("tiny/llama_tied");
    let limits = Limits {
        max_migrations: 0,
        ..busy_limits()
    };
    let mut tc = TestCluster::start_full(&dir, &cfg, vec![], &[1], &[], limits).await;
    tc.workers.push(spawn_worker(&tc.registry_url, &tc.token));
    wait_alive(&tc, 3).await;
    let victim = tc.workers.remove(0);
    let (outcomes, _) = run_through(&tc.generator, &w, 40, || async { kill(&victim, "-KILL") }).await;
    let failed: Vec<&String> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    assert!(!failed.is_empty(), "the sequences running at the kill fail");
    for e in &failed {
        assert!(e.contains("retriable: true") && e.contains("0 time(s)"), "{e}");
    }
    // Those still queued at the kill had not started: they run on the rebuilt pipeline.
    for (i, o) in outcomes.iter().enumerate() {
        if let Ok(tokens) = o {
            assert_eq!(tokens, &w.want[i], "stream {i}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_sampler_continues_its_stream_after_a_migration() {
    let (dir, cfg, mut w) = tiny("tiny/llama_tied");
    w.params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(11),
        ignore_eos: true,
        ..SamplingParams::greedy(100)
    };
    let mut tc = TestCluster::start_full(&dir, &cfg, vec![], &[1], &[], busy_limits()).await;
    // Undisturbed first: what each seeded stream draws.
    let (undisturbed, _) = run_through(&tc.generator, &w, 0, || async {}).await;
    w.want = undisturbed.into_iter().map(Result::unwrap).collect();
    assert!(
        w.want.iter().any(|t| t.iter().any(|&id| id != t[0])),
        "sampling at temperature 0.9 varies"
    );
    tc.workers.push(spawn_worker(&tc.registry_url, &tc.token));
    wait_alive(&tc, 3).await;
    let victim = tc.workers.remove(1);
    let (outcomes, finished) = run_through(&tc.generator, &w, 40, || async { kill(&victim, "-KILL") }).await;
    assert_mid_run(finished);
    assert_all_equal(&outcomes, &w);
    assert!(counter(&tc, |s| &s.migrations) > 0);
}

/// `baton coordinator` on fixed ports (so a restarted one is found at the same address).
fn start_coordinator(model: &std::path::Path, registry: u16, http: u16) -> std::process::Child {
    std::process::Command::new(baton_tests::baton_bin())
        .arg("coordinator")
        .arg("--model")
        .arg(model)
        .args(["--listen", &format!("127.0.0.1:{registry}")])
        .args(["--http", &format!("127.0.0.1:{http}")])
        .args(["--workers", "2", "--cluster-token", "restart-token"])
        .env("BATON_LOG_LEVEL", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("starting baton coordinator")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn after_a_coordinator_restart_workers_register_again_and_serving_resumes() {
    use baton_tests::serve::{http_request, http_status};
    let model = baton_tests::default_model();
    let (registry, http) = (free_port(), free_port());
    let addr = format!("127.0.0.1:{http}");
    let ready = |what: &str| {
        baton_tests::wait_until(what, || match http_status(&addr, "/ready") {
            Some(200) => Ok(()),
            other => Err(format!("/ready answered {other:?}")),
        });
    };
    let complete = || {
        let body = r#"{"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}"#;
        let (code, body) = http_request(&addr, "POST", "/v1/completions", body);
        assert_eq!(code, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let mut coordinator = start_coordinator(&model, registry, http);
    let workers: Vec<_> = (0..2)
        .map(|_| {
            std::process::Command::new(baton_tests::baton_bin())
                .args(["worker", "--listen", "127.0.0.1:0", "--coordinator"])
                .arg(format!("http://127.0.0.1:{registry}"))
                .env("BATON_CLUSTER_TOKEN", "restart-token")
                .env("BATON_LOG_LEVEL", "error")
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    // Killed with the test, whatever happens.
    struct Reap(Vec<std::process::Child>);
    impl Drop for Reap {
        fn drop(&mut self) {
            for c in &mut self.0 {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    let _workers = Reap(workers);
    ready("the first coordinator serves");
    let before = complete();
    coordinator.kill().unwrap();
    coordinator.wait().unwrap();
    let coordinator = Reap(vec![start_coordinator(&model, registry, http)]);
    // The workers' heartbeats fail or go unknown, and they register with the new process.
    ready("the restarted coordinator serves once the workers registered again");
    assert_eq!(complete(), before);
    drop(coordinator);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_that_cannot_serve_does_not_take_down_the_degraded_pipeline() {
    use baton_shared::auth::AddToken;
    use baton_shared::proto::registry_client::RegistryClient;
    use baton_shared::proto::{HeartbeatRequest, RegisterRequest};
    let (dir, cfg, w) = tiny("tiny/llama_tied");
    let limits = Limits {
        measured_split: true,
        heartbeat: Duration::from_secs(1),
        ..busy_limits()
    };
    let mut tc = TestCluster::start_full(&dir, &cfg, vec![], &[1, 2], &[], limits).await;
    let victim = tc.workers.remove(2);
    kill(&victim, "-KILL");
    drop(victim);
    wait_stages(&tc, 2).await;
    // A "worker" registers and heartbeats but nothing listens at its address: growing back to
    // three stages fails on it, and it is left out for a while instead of every second.
    let channel = tonic::transport::Channel::from_shared(tc.registry_url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut registry = RegistryClient::with_interceptor(channel, AddToken::new(&tc.token).unwrap());
    let address = "http://127.0.0.1:9".to_string();
    let req = RegisterRequest {
        address: address.clone(),
        device_kind: "cpu".into(),
        kv_cache_bytes: 1 << 30,
        ..Default::default()
    };
    let id = registry.register(req).await.unwrap().into_inner().worker_id;
    let beats = tokio::spawn(async move {
        loop {
            let beat = HeartbeatRequest {
                worker_id: id.clone(),
                address: address.clone(),
            };
            let _ = registry.heartbeat(beat).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    wait_until_async("the grow-back was tried and given up", || async {
        let last = tc
            .generator
            .status
            .last_replan
            .lock()
            .unwrap()
            .clone()
            .unwrap_or_default();
        if last.starts_with("workers_joined") && tc.generator.ready() && stages(&tc) == 2 {
            Ok(())
        } else {
            Err(format!(
                "{} stages, ready {}, last {last}",
                stages(&tc),
                tc.generator.ready()
            ))
        }
    })
    .await;
    let (outcomes, _) = run_through(&tc.generator, &w, 0, || async {}).await;
    assert_all_equal(&outcomes, &w);
    assert_eq!(stages(&tc), 2, "still the two working stages");
    beats.abort();
}
