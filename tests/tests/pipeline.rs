//! The distributed pipeline with real worker processes (`baton worker`) on loopback: greedy
//! output through 1, 2 and 3 stages equals the single-process engine's, token for token;
//! concurrency, cancellation, authentication, registration and re-assignment (a dying worker
//! is `migration.rs`).

use std::time::Duration;

use baton_coordinator::generation::{FinishReason, GenerationRequest, Generator, TokenEvent};
use baton_shared::auth::AddToken;
use baton_shared::model_files::ModelFiles;
use baton_shared::model_source::LoadedModel;
use baton_shared::proto::worker_client::WorkerClient;
use baton_shared::proto::{HealthRequest, RegisterRequest};
use baton_shared::sampling::SamplingParams;
use baton_tests::cluster::{TestCluster, spawn_worker, wait_for_a_worker, worker_command};
use baton_tests::{PATIENCE, default_model, every_split, fixtures, wait_until_async};
use baton_worker::engine::Engine;
use baton_worker::model::StageWeights;
use baton_worker::service::connect_worker;

fn engine_tokens(model: &std::path::Path, prompt: &[u32], params: &SamplingParams, with_tokenizer: bool) -> Vec<u32> {
    let loaded = with_tokenizer.then(|| LoadedModel::open(model).unwrap());
    let files = ModelFiles::open(model).unwrap();
    let cfg = files.config().unwrap();
    let mut engine = Engine::new(StageWeights::load_full(&files, &cfg, true).unwrap());
    engine
        .generate(prompt, params, loaded.as_ref().map(|m| &m.tokenizer), |_| {})
        .unwrap()
        .tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_models_every_split_matches_single_process() {
    for name in ["llama_untied", "qwen3", "qwen3_moe", "qwen3_moe_dense_mix"] {
        let dir = fixtures().join("tiny").join(name);
        let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(12)
        };
        let prompt = [5u32, 17, 200, 3, 99];
        let want = engine_tokens(&dir, &prompt, &params, false);
        for cuts in every_split(cfg.num_layers) {
            let tc = TestCluster::start(&dir, &cfg, vec![], &cuts).await;
            let (got, reason) = tc.generate(&prompt, params.clone()).await.unwrap();
            assert_eq!(got, want, "{name} with cuts {cuts:?}");
            assert_eq!(reason, FinishReason::Length);
        }
    }
}

#[test]
fn every_split_lists_each_two_and_three_stage_cut() {
    assert_eq!(every_split(3), vec![vec![], vec![1], vec![2], vec![1, 2]]);
    assert_eq!(every_split(5).len(), 1 + 4 + 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixture_of_experts_serves_concurrent_requests_as_each_alone() {
    // Rows of different sequences share each micro-batch and are sorted among the experts
    // together: every sequence must still get exactly its own single-process tokens.
    let dir = fixtures().join("tiny").join("qwen3_moe_dense_mix");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(10)
    };
    let prompts: Vec<Vec<u32>> = (0..8u32)
        .map(|s| (0..3 + 4 * s).map(|i| (s * 37 + i * 11 + 3) % 300).collect())
        .collect();
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| engine_tokens(&dir, p, &params, false)).collect();
    let tc = TestCluster::start(&dir, &cfg, vec![], &[2, 4]).await;
    let got = futures::future::join_all(prompts.iter().map(|p| tc.generate(p, params.clone()))).await;
    for ((p, w), g) in prompts.iter().zip(&want).zip(got) {
        assert_eq!(&g.unwrap().0, w, "prompt {p:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_splits_match_single_process_and_serve_concurrent_requests() {
    let model = default_model();
    let loaded = LoadedModel::open(&model).unwrap();
    let tok = &loaded.tokenizer;
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Rust is a language that",
        "1, 2, 3, 4,",
    ];
    let params = SamplingParams::greedy(12);
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| engine_tokens(&model, &tok.encode(p, true).unwrap(), &params, true))
        .collect();
    for cuts in [&[15][..], &[7, 20]] {
        let tc = TestCluster::start(&model, &loaded.config, tok.eos_ids.clone(), cuts).await;
        // All prompts at once: each must get exactly its own single-process output.
        let encoded: Vec<Vec<u32>> = prompts.iter().map(|p| tok.encode(p, true).unwrap()).collect();
        let runs = encoded.iter().map(|ids| tc.generate(ids, params.clone()));
        let got = futures::future::join_all(runs).await;
        for ((p, w), g) in prompts.iter().zip(&want).zip(got) {
            assert_eq!(&g.unwrap().0, w, "{p:?} with cuts {cuts:?}");
        }
        // Under load every stage had a micro-batch of its own.
        let depth = tc
            .generator
            .status
            .max_in_flight
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            depth as usize,
            cuts.len() + 1,
            "micro-batches in flight with cuts {cuts:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_frees_kv_on_every_stage() {
    let dir = fixtures().join("tiny/llama_tied");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let tc = TestCluster::start(&dir, &cfg, vec![], &[1, 2]).await;
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(200)
    };
    let req = GenerationRequest {
        prompt: vec![1, 2, 3],
        params,
        top_logprobs: 0,
        logprobs: false,
    };
    let mut rx = tc.generator.submit(req).unwrap();
    for _ in 0..3 {
        assert!(matches!(rx.recv().await, Some(TokenEvent::Token { .. })));
    }
    assert_eq!(
        tc.stage_sequences().await,
        vec![1, 1, 1],
        "the sequence holds KV on all three stages"
    );
    drop(rx);
    wait_until_async("KV freed on every stage after cancellation", || async {
        let held = tc.stage_sequences().await;
        if held == vec![0, 0, 0] {
            Ok(())
        } else {
            Err(format!("sequences per stage {held:?}"))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_without_the_cluster_token_are_rejected() {
    let dir = fixtures().join("tiny/llama_tied");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let tc = TestCluster::start(&dir, &cfg, vec![], &[]).await;
    let address = tc.generator.status.assignment.lock().unwrap()[0].address.clone();
    let mut bare = WorkerClient::connect(address.clone()).await.unwrap();
    let e = bare.health(HealthRequest {}).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    let channel = tonic::transport::Channel::from_shared(address)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut wrong = WorkerClient::with_interceptor(channel, AddToken::new("wrong").unwrap());
    assert_eq!(
        wrong.health(HealthRequest {}).await.unwrap_err().code(),
        tonic::Code::Unauthenticated
    );
    let mut registry = baton_shared::proto::registry_client::RegistryClient::connect(tc.registry_url.clone())
        .await
        .unwrap();
    let req = RegisterRequest {
        address: "http://127.0.0.1:1".into(),
        ..Default::default()
    };
    assert_eq!(
        registry.register(req).await.unwrap_err().code(),
        tonic::Code::Unauthenticated
    );
    assert_eq!(tc.cluster.alive().len(), 1, "the rejected registration added nobody");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_retries_until_the_coordinator_appears() {
    // Reserve a port, free it, and point a worker at it (by DNS name) before anything listens.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://localhost:{port}");
    let mut worker = worker_command()
        .args(["--listen", "127.0.0.1:0", "--coordinator", &url])
        .env("BATON_CLUSTER_TOKEN", "t0k")
        .env("BATON_LOG_LEVEL", "warn")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Collect its log as it comes, and start the coordinator only once the worker has failed
    // to register at least once (rather than after a fixed time).
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let stderr = worker.stderr.take().unwrap();
    let collected = log.clone();
    let reader = tokio::spawn(async move {
        use tokio::io::AsyncBufReadExt;
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let mut log = collected.lock().unwrap();
            log.push_str(&line);
            log.push('\n');
        }
    });
    wait_until_async("the worker reports a failed registration", || {
        let log = log.lock().unwrap().clone();
        async move {
            if log.contains("cannot register") {
                Ok(())
            } else {
                Err(format!("log so far: {log:?}"))
            }
        }
    })
    .await;
    let cluster = std::sync::Arc::new(baton_coordinator::registry::Cluster::new(Duration::from_secs(2)));
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.unwrap();
    let c = cluster.clone();
    tokio::spawn(async move {
        baton_coordinator::registry::serve(
            listener,
            c,
            &baton_shared::auth::PeerAuth::plaintext("t0k"),
            &Default::default(),
            std::future::pending(),
        )
        .await
    });
    wait_for_a_worker(&cluster, "the worker registers once the coordinator is up").await;
    worker.kill().await.unwrap();
    worker.wait().await.unwrap();
    reader.await.unwrap();
    let log = log.lock().unwrap().clone();
    assert!(
        log.contains("cannot register") && log.contains(&url),
        "the worker says why it retries: {log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_take_new_layer_ranges_without_restarting_and_stale_streams_close() {
    let dir = fixtures().join("tiny/llama_untied");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let tc = TestCluster::start(&dir, &cfg, vec![], &[1]).await;
    let assignment = tc.generator.status.assignment.lock().unwrap().clone();
    let (mut first, mut second) = (
        connect_worker(&assignment[0].address, &tc.peer).await.unwrap(),
        connect_worker(&assignment[1].address, &tc.peer).await.unwrap(),
    );
    // Move the cut from 1 to 2 on the live processes, with pools as large as the coordinator's
    // allocator (it hands out ids below its block count).
    let kv_blocks = tc
        .generator
        .status
        .kv_blocks_total
        .load(std::sync::atomic::Ordering::Relaxed);
    let load = |start: u32, end: u32, next: &str| baton_shared::proto::LoadStageRequest {
        model: dir.display().to_string(),
        layer_start: start,
        layer_end: end,
        weights: "f32".into(),
        next_stage: next.into(),
        stage_index: u32::from(start > 0),
        kv_blocks,
        kv_block_size: 16,
        ..Default::default()
    };
    first.load_stage(load(0, 2, &assignment[1].address)).await.unwrap();
    second.load_stage(load(2, 3, "")).await.unwrap();
    let h = first.health(HealthRequest {}).await.unwrap().into_inner();
    assert_eq!(
        h.stage.map(|s| (s.layer_start, s.layer_end, s.first, s.last)),
        Some((0, 2, true, false))
    );
    let f32_bytes = h.kv_bytes;
    // A bad range is refused with a clear error and leaves the stage as it was.
    let e = first.load_stage(load(2, 9, "")).await.unwrap_err();
    assert!(e.message().contains("layer range 2..9"), "{}", e.message());
    // So is a KV pool without blocks, or one larger than the worker's kv_cache_mib.
    let e = first
        .load_stage(baton_shared::proto::LoadStageRequest {
            kv_blocks: 0,
            ..load(0, 2, &assignment[1].address)
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("must both be positive"), "{}", e.message());
    let e = first
        .load_stage(baton_shared::proto::LoadStageRequest {
            kv_blocks: 1 << 40,
            ..load(0, 2, &assignment[1].address)
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("KV budget"), "{}", e.message());
    // An unknown KV dtype is refused by name; an f16 pool takes half the bytes of an f32 one.
    let e = first
        .load_stage(baton_shared::proto::LoadStageRequest {
            kv_dtype: "int3".into(),
            ..load(0, 2, &assignment[1].address)
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("KV cache dtype 'int3'"), "{}", e.message());
    for (client, req) in [
        (&mut first, load(0, 2, &assignment[1].address)),
        (&mut second, load(2, 3, "")),
    ] {
        let req = baton_shared::proto::LoadStageRequest {
            kv_dtype: "f16".into(),
            ..req
        };
        client.load_stage(req).await.unwrap();
    }
    let h = first.health(HealthRequest {}).await.unwrap().into_inner();
    assert_eq!(h.kv_bytes * 2, f32_bytes);
    assert_eq!(h.kv_capacity_tokens, kv_blocks * 16);
    // The coordinator's stream belongs to the stages it loaded: the reloaded stage closes it
    // at the next micro-batch instead of running it, and the coordinator rebuilds its own
    // pipeline (loading its ranges again) and serves the request there.
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(8)
    };
    let prompt = [9u32, 8, 7];
    let (got, _) = tc.generate(&prompt, params.clone()).await.unwrap();
    assert_eq!(got, engine_tokens(&dir, &prompt, &params, false));
    let status = &tc.generator.status;
    assert_eq!(status.replans.load(std::sync::atomic::Ordering::Relaxed), 1);
    let h = first.health(HealthRequest {}).await.unwrap().into_inner();
    assert_eq!(h.stage.map(|s| (s.layer_start, s.layer_end)), Some((0, 1)));
}

/// GET http://addr/metrics.
fn scrape(addr: &str) -> String {
    let (code, body) = baton_tests::serve::http_request(addr, "GET", "/metrics", "");
    assert_eq!(code, 200, "{body}");
    body
}

/// Every non-comment line is `name{labels} value` with a numeric value.
fn assert_prometheus_text(text: &str) {
    for line in text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad line {line:?}"));
        assert!(series.starts_with("baton_"), "unprefixed series {line:?}");
        assert!(
            value.parse::<f64>().is_ok() || ["+Inf", "-Inf", "NaN"].contains(&value),
            "bad value in {line:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_export_stage_metrics() {
    let dir = fixtures().join("tiny/llama_tied");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let (tc, ports) = TestCluster::start_with_worker_metrics(&dir, &cfg, &[1]).await;
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(6)
    };
    tc.generate(&[1, 2, 3], params).await.unwrap();
    let texts: Vec<String> = ports.iter().map(|addr| scrape(addr)).collect();
    // Workers register in any order, so find which one became which stage.
    let stage_of = |text: &str| {
        ["0", "1"]
            .into_iter()
            .find(|s| text.contains(&format!("baton_stage_forward_seconds_bucket{{stage=\"{s}\"")))
            .unwrap_or_else(|| panic!("no stage_forward histogram: {text}"))
    };
    let mut stages: Vec<&str> = texts.iter().map(|t| stage_of(t)).collect();
    stages.sort();
    assert_eq!(stages, vec!["0", "1"]);
    for text in &texts {
        assert_prometheus_text(text);
        assert!(text.contains("baton_worker_kv_tokens"), "{text}");
        assert!(text.contains("baton_kernel_info{path=\""), "{text}");
        assert!(
            text.contains("baton_stage_backend_info{") && text.contains("device=\"cpu\""),
            "{text}"
        );
        assert!(
            text.contains("kv_dtype=\"f32\"") && text.contains("baton_worker_kv_bytes "),
            "{text}"
        );
    }
    // Stage 0 sends 64-float hidden rows: 3 prompt rows + 5 decode rows of 4 bytes each.
    let first = texts.iter().find(|t| stage_of(t) == "0").unwrap();
    assert!(
        first.contains("baton_transfer_bytes_total{stage=\"0\"} 2048"),
        "{first}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixture_of_experts_workers_report_the_experts_each_micro_batch_reads() {
    // qwen3_moe_dense_mix: layers 0 and 3 dense; 1, 2 and 4 sparse, 2 of 12 experts a row.
    let dir = fixtures().join("tiny/qwen3_moe_dense_mix");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let (tc, ports) = TestCluster::start_with_worker_metrics(&dir, &cfg, &[3]).await;
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(4)
    };
    tc.generate(&[1, 2, 3, 4, 5, 6, 7, 8], params).await.unwrap();
    let mut by_expert = 0;
    for addr in ports {
        let text = scrape(&addr);
        assert_prometheus_text(&text);
        // The CPU runs experts one by one: every sparse layer of every micro-batch.
        let layers = |path: &str| -> u64 {
            let prefix = format!("baton_moe_layers_total{{experts=\"{path}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .map_or(0, |v| v.trim().parse().unwrap())
        };
        assert_eq!(layers("one_go"), 0, "{text}");
        by_expert += layers("by_expert");
        let count = text
            .lines()
            .find_map(|l| l.strip_prefix("baton_moe_active_experts_count "))
            .unwrap_or_else(|| panic!("no baton_moe_active_experts histogram: {text}"));
        // One micro-batch per step: the prompt, then 3 decode steps (the 4th token is
        // sampled from the last of them).
        assert_eq!(count.trim(), "4", "{text}");
        let sum: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("baton_moe_active_experts_sum "))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // A decode row reads exactly top-k (2) experts per sparse layer; the 8-row prompt
        // between 2 and all 12.
        assert!((6.0 + 2.0..=6.0 + 12.0).contains(&sum), "{sum}: {text}");
    }
    // Three sparse layers (split over the two stages), four micro-batches.
    assert_eq!(by_expert, 3 * 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trim_keeps_a_prefix_and_a_cached_prefix_starts_a_sequence() {
    use baton_shared::proto::{MicroBatch, Sampling, SequenceChunk, TrimRequest};
    let dir = fixtures().join("tiny/llama_tied");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let tc = TestCluster::start(&dir, &cfg, vec![], &[]).await;
    let address = tc.generator.status.assignment.lock().unwrap()[0].address.clone();
    let mut client = connect_worker(&address, &tc.peer).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut results = client
        .forward(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    // Block ids far from the coordinator's (it allocates from 0, and is idle here).
    let chunk = |seq_id: u64, tokens: Vec<u32>, pos0| SequenceChunk {
        seq_id,
        tokens,
        pos0,
        sample: true,
        sampling: (pos0 == 0).then(Sampling::default),
        blocks: vec![1000 + seq_id as u32 % 100],
        cached: 0,
        draft: 0,
        taps: false,
        propose: 0,
        restore_state: None,
        save_state: None,
        prompt_len: 0,
    };
    let mut step = async |c: SequenceChunk| {
        tx.send(MicroBatch {
            batch_id: 1,
            seqs: vec![c],
            ..Default::default()
        })
        .await
        .unwrap();
        futures::StreamExt::next(&mut results).await.unwrap().unwrap()
    };
    step(chunk(900, vec![1, 2, 3, 4, 5], 0)).await;
    let trimmed = client
        .trim(TrimRequest { seq_id: 900, length: 2 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(trimmed.length, 2);
    let continued = step(chunk(900, vec![7], 2)).await;
    let fresh = step(chunk(901, vec![1, 2, 7], 0)).await;
    assert!(continued.error.is_empty() && fresh.error.is_empty());
    assert_eq!(
        continued.results[0].token, fresh.results[0].token,
        "trim + continue equals a fresh prefix"
    );
    let wrong = step(chunk(900, vec![8], 9)).await;
    assert!(wrong.error.contains("KV cache holds 3 positions"), "{}", wrong.error);
    // A block table that does not cover the chunk, or names blocks the pool lacks, is refused.
    let short = step(SequenceChunk {
        blocks: vec![],
        ..chunk(902, vec![1, 2], 0)
    })
    .await;
    assert!(
        short.error.contains("need 1 KV blocks but the block table has 0"),
        "{}",
        short.error
    );
    let foreign = step(SequenceChunk {
        blocks: vec![u32::MAX],
        ..chunk(903, vec![1, 2], 0)
    })
    .await;
    assert!(foreign.error.contains("outside the pool"), "{}", foreign.error);

    // A sequence that starts on another's cached full block (positions 0..16 of block 1050)
    // and computes only the rest samples what the full prompt alone samples.
    let prompt: Vec<u32> = (1..=20).collect();
    let whole = step(SequenceChunk {
        blocks: vec![1050, 1051],
        ..chunk(910, prompt.clone(), 0)
    })
    .await;
    let reused = step(SequenceChunk {
        blocks: vec![1050, 1052],
        cached: 16,
        draft: 0,
        sampling: Some(Sampling::default()),
        ..chunk(911, prompt[16..].to_vec(), 16)
    })
    .await;
    assert!(
        whole.error.is_empty() && reused.error.is_empty(),
        "{} {}",
        whole.error,
        reused.error
    );
    assert_eq!(whole.results[0].token, reused.results[0].token);
    let next = step(SequenceChunk {
        blocks: vec![1050, 1052],
        ..chunk(911, vec![whole.results[0].token], 20)
    })
    .await;
    assert!(next.error.is_empty(), "the reused sequence continues: {}", next.error);
    let misplaced = step(SequenceChunk {
        blocks: vec![1050, 1053],
        cached: 16,
        draft: 0,
        ..chunk(912, prompt[..4].to_vec(), 0)
    })
    .await;
    assert!(
        misplaced
            .error
            .contains("reusing 16 cached positions must start at position 16"),
        "{}",
        misplaced.error
    );
    let e = client
        .trim(TrimRequest {
            seq_id: 12345,
            length: 1,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_worker_deregisters() {
    // Heartbeats every 60 s (dead after 180 s, longer than any wait here): only an explicit
    // Deregister can have removed the worker.
    let cluster = std::sync::Arc::new(baton_coordinator::registry::Cluster::new(Duration::from_secs(60)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let c = cluster.clone();
    tokio::spawn(async move {
        baton_coordinator::registry::serve(
            listener,
            c,
            &baton_shared::auth::PeerAuth::plaintext("tok"),
            &Default::default(),
            std::future::pending(),
        )
        .await
    });
    let mut worker = spawn_worker(&url, "tok");
    wait_for_a_worker(&cluster, "the worker registers").await;
    let pid = worker.id().unwrap().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::time::timeout(PATIENCE, worker.wait())
        .await
        .expect("worker exits on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
    assert!(
        cluster.alive().is_empty(),
        "the worker removed itself from the registry"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_is_bounded_by_running_and_queue_limits() {
    use baton_coordinator::generation::SubmitError;
    use baton_tests::cluster::Limits;
    let dir = fixtures().join("tiny/llama_tied");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let limits = Limits {
        max_running: 1,
        max_queue: 1,
        ..Limits::default()
    };
    let tc = TestCluster::start_full(&dir, &cfg, vec![], &[], &[], limits).await;
    let long = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(200)
    };
    let req = |params: SamplingParams| GenerationRequest {
        prompt: vec![1, 2],
        params,
        top_logprobs: 0,
        logprobs: false,
    };
    let mut running = tc.generator.submit(req(long.clone())).unwrap();
    assert!(
        matches!(running.recv().await, Some(TokenEvent::Token { .. })),
        "the first request runs"
    );
    let mut queued = tc
        .generator
        .submit(req(SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(3)
        }))
        .unwrap();
    let e = tc.generator.submit(req(long.clone())).unwrap_err();
    assert!(matches!(e, SubmitError::Overloaded(_)), "{e}");
    assert_eq!(tc.stage_sequences().await, vec![1], "only one sequence holds KV");
    // Cancelling the running request lets the queued one through.
    drop(running);
    let mut tokens = 0;
    while let Some(ev) = queued.recv().await {
        match ev {
            TokenEvent::PromptCached { .. } => {}
            TokenEvent::Token { .. } => tokens += 1,
            TokenEvent::Done { .. } => break,
            TokenEvent::Failed { message, .. } => panic!("{message}"),
        }
    }
    assert_eq!(tokens, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_prefill_gives_the_same_tokens() {
    use baton_tests::cluster::Limits;
    let dir = fixtures().join("tiny/qwen2");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(10)
    };
    let long: Vec<u32> = (0..41).map(|i| (i * 7 % 300) as u32 + 3).collect();
    let short = [5u32, 6, 7];
    let want_long = engine_tokens(&dir, &long, &params, false);
    let want_short = engine_tokens(&dir, &short, &params, false);
    // A 5-token step budget: the long prompt takes many steps while the short one decodes.
    let limits = Limits {
        max_batch_tokens: 5,
        ..Limits::default()
    };
    let tc = TestCluster::start_full(&dir, &cfg, vec![], &[2], &[], limits).await;
    let (a, b) = tokio::join!(tc.generate(&short, params.clone()), tc.generate(&long, params.clone()));
    assert_eq!(a.unwrap().0, want_short);
    assert_eq!(b.unwrap().0, want_long);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_long_prompt_has_a_chunk_on_every_stage_and_the_same_tokens() {
    // Wavefront prefill: three stages, 6 tokens a step (2 a micro-batch), one 41-token prompt
    // and nothing else running. Its chunks follow each other through the stages, up to one per
    // stage at a time, and the greedy continuation equals the single engine's.
    use baton_tests::cluster::Limits;
    let dir = fixtures().join("tiny/qwen2");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(8)
    };
    let long: Vec<u32> = (0..41).map(|i| (i * 11 % 300) as u32 + 3).collect();
    let want = engine_tokens(&dir, &long, &params, false);
    let limits = Limits {
        max_batch_tokens: 6,
        ..Limits::default()
    };
    let tc = TestCluster::start_full(&dir, &cfg, vec![], &[1, 2], &[], limits).await;
    let (got, _) = tc.generate(&long, params).await.unwrap();
    assert_eq!(got, want);
    let most = tc
        .generator
        .status
        .max_in_flight
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(most, 3, "one sequence alone had a micro-batch on each of the 3 stages");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_loaded_beside_the_served_one_takes_over_only_when_activated() {
    let dir = fixtures().join("tiny/llama_untied");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let tc = TestCluster::start(&dir, &cfg, vec![], &[1]).await;
    let assignment = tc.generator.status.assignment.lock().unwrap().clone();
    let mut last = connect_worker(&assignment[1].address, &tc.peer).await.unwrap();
    let kv_blocks = tc
        .generator
        .status
        .kv_blocks_total
        .load(std::sync::atomic::Ordering::Relaxed);
    let range = |h: baton_shared::proto::HealthResponse| h.stage.map(|s| (s.layer_start, s.layer_end));
    // Layers 2..3 loaded beside the served 1..3: the worker keeps serving 1..3.
    let staged = baton_shared::proto::LoadStageRequest {
        model: dir.display().to_string(),
        layer_start: 2,
        layer_end: 3,
        weights: "f32".into(),
        stage_index: 1,
        kv_blocks,
        kv_block_size: 16,
        staged: true,
        ..Default::default()
    };
    last.load_stage(staged).await.unwrap();
    let h = last.health(HealthRequest {}).await.unwrap().into_inner();
    assert_eq!(range(h), Some((1, 3)), "a staged load serves nothing yet");
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(6)
    };
    let prompt = [4u32, 40, 44];
    let want = engine_tokens(&dir, &prompt, &params, false);
    let (got, _) = tc.generate(&prompt, params.clone()).await.unwrap();
    assert_eq!(got, want, "the pipeline serves on, undisturbed");
    assert_eq!(
        tc.generator.status.replans.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    // Activated, it serves 2..3.
    let info = last
        .activate_stage(baton_shared::proto::ActivateStageRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.stage.map(|s| (s.layer_start, s.layer_end)), Some((2, 3)));
    let h = last.health(HealthRequest {}).await.unwrap().into_inner();
    assert_eq!(range(h), Some((2, 3)));
    // Nothing is staged any more.
    let e = last
        .activate_stage(baton_shared::proto::ActivateStageRequest {})
        .await
        .unwrap_err();
    assert!(e.message().contains("no staged stage"), "{}", e.message());
}
