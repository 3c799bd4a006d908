//! The measured split planner end to end: the worker's profiler (in process and over gRPC), and
//! pipelines whose layer ranges the coordinator planned from real workers' profiles.

use baton_coordinator::generation::Generator;
use baton_shared::model_files::ModelFiles;
use baton_shared::model_source::LoadedModel;
use baton_shared::proto::ProfileRequest;
use baton_shared::sampling::SamplingParams;
use baton_tests::cluster::{Limits, TestCluster};
use baton_tests::{default_model, fixtures};
use baton_worker::backend::{self, BackendOptions, CpuOptions, Device};
use baton_worker::engine::Engine;
use baton_worker::kv_cache::KvDtype;
use baton_worker::model::{StageWeights, WeightFormat};
use baton_worker::profiler::{self, ProfileError, ProfileSpec};
use baton_worker::service::connect_worker;

fn opts(format: WeightFormat) -> BackendOptions {
    BackendOptions {
        device: Device::Cpu { threads: Some(1) },
        format,
        cpu: CpuOptions::threads(1),
        check_finite: true,
        kv_blocks: 4,
        kv_block_size: 16,
        kv_dtype: KvDtype::F32,
        state_slots: 0,
        state_snapshots: 0,
    }
}

/// What a stage's parts take in memory, from the model's shapes alone (not from the loader's
/// own count, which the profile and the stages share): (one layer, the embedding, the final
/// norm with the head). Matrices are f32, or Q8_0 in panels of 16 rows (zero-padded), each row
/// a byte per weight and an f32 scale per block of 32; vectors stay f32; an f32 head tied to
/// the embedding is the embedding itself.
fn bytes_from_shapes(cfg: &baton_shared::model_config::ModelConfig, format: WeightFormat) -> (usize, usize, usize) {
    let matrix = |rows: usize, cols: usize| match format {
        WeightFormat::F32 => 4 * rows * cols,
        WeightFormat::Q8_0 => {
            let padded = rows.div_ceil(16) * 16;
            padded * cols + 4 * padded * (cols / 32)
        }
        other => panic!("no byte count for {other} here"),
    };
    let (h, ffn, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (q, kv) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    let vectors = 2 * h + if cfg.qkv_bias { q + 2 * kv } else { 0 } + if cfg.qk_norm { 2 * cfg.head_dim } else { 0 };
    let layer = matrix(q, h) + 2 * matrix(kv, h) + matrix(h, q) + 2 * matrix(ffn, h) + matrix(h, ffn) + 4 * vectors;
    let embedding = 4 * vocab * h;
    let head = 4 * h
        + match (format, cfg.tie_word_embeddings) {
            (WeightFormat::F32, true) => embedding,
            _ => matrix(vocab, h),
        };
    (layer, embedding, head)
}

#[test]
fn the_profile_times_every_part_and_its_bytes_match_real_stages() {
    let spec = ProfileSpec {
        token_counts: vec![1, 4, 16],
        context: 40,
        reps: 1,
        min_seconds: 0.0,
    };
    let smollm2 = default_model();
    let cases = [
        (fixtures().join("tiny/llama_untied"), WeightFormat::F32),
        (fixtures().join("tiny/llama_tied"), WeightFormat::F32),
        (fixtures().join("tiny/qwen3"), WeightFormat::Q8_0),
        (smollm2, WeightFormat::Q8_0),
    ];
    for (model, format) in cases {
        let files = ModelFiles::open(&model).unwrap();
        let cfg = files.config().unwrap();
        let label = format!("{} as {format}", model.display());
        let p = profiler::profile(&files, &cfg, &opts(format), &spec, 1 << 30).unwrap();
        for (part, points) in [("layer", &p.layer), ("head", &p.head), ("embed", &p.embed)] {
            let tokens: Vec<usize> = points.iter().map(|c| c.tokens).collect();
            assert_eq!(tokens, spec.token_counts, "{label}: {part}");
            assert!(
                points.iter().all(|c| c.seconds.is_finite() && c.seconds > 0.0),
                "{label}: {part} {points:?}"
            );
        }
        assert_eq!(p.threads, 1);
        assert!(!p.kernels.is_empty());
        // The profile's part sizes are what the shapes say.
        let (layer, embedding, head) = bytes_from_shapes(&cfg, format);
        assert_eq!(
            (p.bytes.layers, p.bytes.embedding, p.bytes.head),
            (layer, embedding, head),
            "{label}: profiled bytes (layer, embedding, head) vs the shapes'"
        );
        // A first stage holds one layer's bytes per layer plus the embedding; a last stage the
        // layers plus the head (a tied f32 head borrows the embedding and counts it).
        let l = cfg.num_layers;
        let first = backend::load(&files, &cfg, 0..1, &opts(format)).unwrap().info();
        let last = backend::load(&files, &cfg, 1..l, &opts(format)).unwrap().info();
        assert_eq!(first.weight_bytes, layer + embedding, "{label}: first stage");
        assert_eq!(last.weight_bytes, (l - 1) * layer + head, "{label}: last stage");
    }
}

#[test]
fn each_layer_class_is_profiled_from_its_own_layers() {
    // A dense model has one class; a mix of dense and sparse layers two; the hybrids linear
    // and full attention (with or without experts). Each class the model has gets its own
    // curve, for its first layer, with that layer's bytes as a stage of it alone holds them.
    let spec = ProfileSpec {
        token_counts: vec![1, 4],
        context: 24,
        reps: 1,
        min_seconds: 0.0,
    };
    let cases = [
        ("qwen3", vec!["attention+dense"]),
        ("qwen3_moe_dense_mix", vec!["attention+dense", "attention+moe"]),
        (
            "qwen3_next",
            vec!["attention+moe", "linear_attention+dense", "linear_attention+moe"],
        ),
        ("qwen3_next_dense", vec!["attention+dense", "linear_attention+dense"]),
        ("qwen3_5_moe", vec!["attention+moe", "linear_attention+moe"]),
    ];
    for (name, classes) in cases {
        let dir = fixtures().join("tiny").join(name);
        let files = ModelFiles::open(&dir).unwrap();
        let cfg = files.config().unwrap();
        let mut o = opts(WeightFormat::Q8_0);
        o.state_slots = 4;
        let p = profiler::profile(&files, &cfg, &o, &spec, 1 << 30).unwrap();
        let mut got: Vec<&str> = p.classes.iter().map(|c| c.class.name()).collect();
        got.sort_unstable();
        assert_eq!(got, classes, "{name}");
        let arch = baton_worker::model::registry::for_config(&cfg);
        for c in &p.classes {
            let tokens: Vec<usize> = c.layer.iter().map(|pt| pt.tokens).collect();
            assert_eq!(tokens, spec.token_counts, "{name}: {}", c.class.name());
            assert!(
                c.layer.iter().all(|pt| pt.seconds.is_finite() && pt.seconds > 0.0),
                "{name}: {c:?}"
            );
            let first = (0..cfg.num_layers)
                .find(|&l| arch.layer(&cfg, l).spec().class() == c.class)
                .unwrap();
            let alone = backend::load(&files, &cfg, first..first + 1, &o).unwrap().info();
            assert_eq!(c.bytes, alone.part_bytes.layers, "{name}: {} bytes", c.class.name());
        }
    }
}

#[test]
fn bad_profile_requests_are_refused_by_name() {
    let files = ModelFiles::open(&fixtures().join("tiny/llama_untied")).unwrap();
    let cfg = files.config().unwrap();
    let spec = |counts: Vec<usize>, context| ProfileSpec {
        token_counts: counts,
        context,
        reps: 1,
        min_seconds: 0.0,
    };
    let run = |s: &ProfileSpec, budget| profiler::profile(&files, &cfg, &opts(WeightFormat::F32), s, budget);
    for counts in [vec![], vec![0, 4], vec![5000], vec![4, 4], (1..=33).collect()] {
        let e = run(&spec(counts.clone(), 8), 1 << 30).unwrap_err();
        assert!(matches!(e, ProfileError::TokenCounts(_)), "{counts:?}: {e}");
        assert!(e.to_string().contains("token counts"), "{e}");
    }
    let e = run(
        &ProfileSpec {
            reps: 1000,
            ..spec(vec![1], 8)
        },
        1 << 30,
    )
    .unwrap_err();
    assert!(e.to_string().contains("repetitions must be at most 100"), "{e}");
    let e = run(&spec(vec![1], 40_000), 1 << 30).unwrap_err();
    assert!(e.to_string().contains("context of 40000"), "{e}");
    let e = run(
        &ProfileSpec {
            min_seconds: 5.0,
            ..spec(vec![1], 8)
        },
        1 << 30,
    )
    .unwrap_err();
    assert!(e.to_string().contains("time per point of 5 s"), "{e}");
    // Timing each point for a while repeats it until the time is up.
    let p = run(
        &ProfileSpec {
            min_seconds: 0.02,
            ..spec(vec![1], 8)
        },
        1 << 30,
    )
    .unwrap();
    assert!(p.layer[0].seconds > 0.0);
    let e = run(&spec(vec![64], 128), 1000).unwrap_err();
    assert!(
        e.to_string().contains("KV budget of 1000 bytes"),
        "a profile too large for the worker's KV budget: {e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measured_splits_serve_what_one_process_computes() {
    // SmolLM2 over three workers, and a tiny model over two: the coordinator profiles each
    // worker, plans, and the pipeline's greedy output is the engine's whatever ranges it chose.
    let model = default_model();
    let loaded = LoadedModel::open(&model).unwrap();
    let tiny = fixtures().join("tiny/qwen3");
    let tiny_cfg = ModelFiles::open(&tiny).unwrap().config().unwrap();
    // A hybrid: each stage worker's linear- and full-attention layers are costed apart.
    let hybrid = fixtures().join("tiny/qwen3_next");
    let hybrid_cfg = ModelFiles::open(&hybrid).unwrap().config().unwrap();
    let cases = [
        (
            &model,
            &loaded.config,
            3,
            loaded.tokenizer.encode("The capital of France is", true).unwrap(),
        ),
        (&tiny, &tiny_cfg, 2, vec![5, 17, 200, 3, 99]),
        (&hybrid, &hybrid_cfg, 2, vec![5, 17, 200, 3, 99]),
    ];
    for (path, cfg, stages, prompt) in cases {
        let files = ModelFiles::open(path).unwrap();
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(10)
        };
        let want = Engine::new(StageWeights::load_full(&files, cfg, true).unwrap())
            .generate(&prompt, &params, None, |_| {})
            .unwrap()
            .tokens;
        let limits = Limits {
            measured_split: true,
            ..Limits::default()
        };
        let cuts: Vec<usize> = (1..stages).collect();
        let tc = TestCluster::start_full(path, cfg, vec![], &cuts, &[], limits).await;
        let (got, _) = tc.generate(&prompt, params).await.unwrap();
        assert_eq!(got, want, "{} over {stages} planned stages", path.display());

        let view = tc.generator.describe();
        let split = &view["split"];
        assert_eq!(split["policy"], "measured", "{view}");
        // Planned for a prompt chunk (a micro-batch's share of the step's tokens, one sampled)
        // and a decode step (8 running sequences' tokens shared among the micro-batches in
        // flight), each within a finite factor of its own best split.
        let shapes = split["shapes"].as_array().unwrap();
        let shape = |i: usize, key: &str| shapes[i][key].as_u64().unwrap() as usize;
        assert_eq!(
            (&shapes[0]["shape"], &shapes[1]["shape"]),
            (&"prompt_chunk".into(), &"decode".into()),
            "{view}"
        );
        assert_eq!(shape(0, "sampled"), 1, "{view}");
        assert!(shape(0, "tokens") >= 1, "{view}");
        assert_eq!(
            (shape(1, "tokens"), shape(1, "sampled")),
            (8usize.div_ceil(stages), 8usize.div_ceil(stages)),
            "{view}"
        );
        for s in shapes {
            let slowdown = s["slowdown"].as_f64().unwrap();
            assert!((1.0 - 1e-9..10.0).contains(&slowdown), "{view}");
            assert_eq!(s["predicted_stage_ms"].as_array().unwrap().len(), stages, "{view}");
        }
        let ranges: Vec<(u64, u64)> = view["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["layer_start"].as_u64().unwrap(), s["layer_end"].as_u64().unwrap()))
            .collect();
        assert_eq!(ranges.len(), stages);
        assert_eq!(ranges[0].0, 0);
        assert_eq!(ranges[stages - 1].1, cfg.num_layers as u64);
        assert!(
            ranges.windows(2).all(|w| w[0].1 == w[1].0) && ranges.iter().all(|r| r.0 < r.1),
            "{ranges:?}"
        );
        for s in view["stages"].as_array().unwrap() {
            for shape in ["prompt_chunk", "decode"] {
                let ms = s["predicted_ms"][shape].as_f64().unwrap_or(0.0);
                assert!(
                    ms > 0.0 && ms.is_finite(),
                    "every stage has a predicted time for each shape: {s}"
                );
            }
        }
        // Every stage worker's cost of one layer of each of the model's classes, measured.
        let arch = baton_worker::model::registry::for_config(cfg);
        let mut classes: Vec<&str> = (0..cfg.num_layers)
            .map(|l| arch.layer(cfg, l).spec().class().name())
            .collect();
        classes.sort_unstable();
        classes.dedup();
        let per_stage = split["layer_class_ms"].as_array().unwrap();
        assert_eq!(per_stage.len(), stages, "{view}");
        for costs in per_stage {
            let mut names: Vec<&str> = costs.as_object().unwrap().keys().map(|k| k.as_str()).collect();
            names.sort_unstable();
            assert_eq!(names, classes, "{view}");
            assert!(
                costs
                    .as_object()
                    .unwrap()
                    .values()
                    .all(|ms| ms.as_f64().is_some_and(|ms| ms > 0.0)),
                "{view}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_profile_rpc_answers_and_refuses_bad_requests() {
    let dir = fixtures().join("tiny/llama_untied");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let tc = TestCluster::start(&dir, &cfg, vec![], &[]).await;
    let address = tc.generator.status.assignment.lock().unwrap()[0].address.clone();
    let mut client = connect_worker(&address, &tc.peer).await.unwrap();
    let req = |weights: &str, counts: Vec<u32>| ProfileRequest {
        model: dir.display().to_string(),
        weights: weights.into(),
        token_counts: counts,
        context: 32,
        reps: 1,
        min_millis: 0,
        kv_dtype: String::new(),
    };
    let p = client.profile(req("q8_0", vec![1, 8])).await.unwrap().into_inner();
    assert_eq!(p.layer.iter().map(|c| c.tokens).collect::<Vec<_>>(), [1, 8]);
    assert!(p.head.iter().chain(&p.embed).all(|c| c.seconds > 0.0));
    assert!(p.layer_weight_bytes > 0 && p.head_weight_bytes > 0 && p.embed_weight_bytes > 0);
    // The model's one layer class, timed layer by layer.
    let classes: Vec<&str> = p.classes.iter().map(|c| c.class.as_str()).collect();
    assert_eq!(classes, ["attention+dense"]);
    assert_eq!(p.classes[0].weight_bytes, p.layer_weight_bytes);
    assert!(p.classes[0].layer.iter().all(|c| c.seconds > 0.0));
    // Attention timed over an f16 KV pool, as a pipeline with kv_dtype = "f16" runs it.
    let f16 = ProfileRequest {
        kv_dtype: "f16".into(),
        ..req("f32", vec![4])
    };
    assert!(client.profile(f16).await.unwrap().into_inner().layer[0].seconds > 0.0);
    let e = client
        .profile(ProfileRequest {
            kv_dtype: "int3".into(),
            ..req("f32", vec![4])
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("'int3'"), "{}", e.message());
    let e = client.profile(req("int2", vec![1])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("int2"), "{}", e.message());
    let e = client.profile(req("f32", vec![])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("token counts"), "{}", e.message());
    let e = client
        .profile(ProfileRequest {
            model: "/nonexistent/model.gguf".into(),
            ..req("f32", vec![1])
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("/nonexistent/model.gguf"), "{}", e.message());
    // The worker still serves after the refusals, and serves what one process computes.
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(3)
    };
    let (got, _) = tc.generate(&[3, 4, 5], params.clone()).await.unwrap();
    let files = ModelFiles::open(&dir).unwrap();
    let want = Engine::new(StageWeights::load_full(&files, &cfg, true).unwrap())
        .generate(&[3, 4, 5], &params, None, |_| {})
        .unwrap()
        .tokens;
    assert_eq!(got, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_left_open_are_sized_from_the_profiles_and_the_kv_pool() {
    // An even split (the planner measures nothing) over two workers, with the running limit and
    // the step's tokens left open: the coordinator profiles the workers for them. 48 blocks of
    // 16 positions hold three sequences at the tiny model's 256-position context, so at most three
    // run at once; every output is still what one process computes.
    use baton_coordinator::pipeline::sizing::AutoLimits;
    let tiny = fixtures().join("tiny/qwen3");
    let cfg = ModelFiles::open(&tiny).unwrap().config().unwrap();
    let files = ModelFiles::open(&tiny).unwrap();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(6)
    };
    let prompts: Vec<Vec<u32>> = (0..5u32)
        .map(|i| (0..(3 + 5 * i)).map(|t| (t * 13 + i) % 250 + 3).collect())
        .collect();
    let alone = |p: &[u32]| {
        let mut engine = Engine::new(StageWeights::load_full(&files, &cfg, true).unwrap());
        engine.generate(p, &params, None, |_| {}).unwrap().tokens
    };
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone(p)).collect();
    let limits = Limits {
        kv_max_blocks: Some(48),
        auto_limits: AutoLimits {
            max_running: true,
            max_batch_tokens: true,
        },
        ..Limits::default()
    };
    let tc = TestCluster::start_full(&tiny, &cfg, vec![], &[1], &[], limits).await;
    let runs = prompts.iter().map(|p| tc.generate(p, params.clone()));
    let got: Vec<Vec<u32>> = futures::future::join_all(runs)
        .await
        .into_iter()
        .map(|r| r.unwrap().0)
        .collect();
    assert_eq!(got, want);
    let view = tc.generator.describe();
    let limits = &view["limits"];
    assert_eq!(limits["max_running"], 3, "{view}");
    assert_eq!(limits["max_running_bound"], "kv_pool", "{view}");
    assert_eq!(view["max_running"], 3, "{view}");
    let tokens_bound = limits["max_batch_tokens_bound"].as_str().unwrap();
    assert!(
        ["amortized", "step_seconds", "decode_rows"].contains(&tokens_bound),
        "the step's tokens were sized from the profiles: {view}"
    );
    assert!(limits["max_batch_tokens"].as_u64().unwrap() >= 3, "{view}");
}
