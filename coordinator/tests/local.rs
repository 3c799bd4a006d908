//! The in-process pipeline (`--workers 0`: the whole model as one stage under the same step
//! loop as workers) on a tiny fixture model: same tokens as the reference engine even when
//! requests share micro-batches, stop conditions, logprobs, validation, queue limits,
//! cancellation, and a clear error for a model it cannot load.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use baton_coordinator::generation::{FinishReason, GenerationRequest, Generator, SubmitError, TokenEvent};
use baton_coordinator::local::{self, LocalError, LocalStageOptions};
use baton_coordinator::pipeline::{PipelineConfig, PipelineGenerator};
use baton_shared::model_files::ModelFiles;
use baton_shared::sampling::SamplingParams;
use baton_worker::engine::Engine;
use baton_worker::model::StageWeights;
use tokio::runtime::Runtime;
use tokio::sync::mpsc;

/// How long any one wait in these tests may take before it fails (generous: a loaded 2-core
/// machine runs many test binaries at once).
const DEADLINE: Duration = Duration::from_secs(120);

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny/llama_tied")
}

fn weights() -> StageWeights {
    let files = ModelFiles::open(&tiny()).unwrap();
    let config = files.config().unwrap();
    StageWeights::load_full(&files, &config, true).unwrap()
}

/// An in-process pipeline with its runtime (dropped together).
struct Local {
    generator: PipelineGenerator,
    rt: Runtime,
}

impl std::ops::Deref for Local {
    type Target = PipelineGenerator;
    fn deref(&self) -> &PipelineGenerator {
        &self.generator
    }
}

/// The tiny model in process, ready, with `eos` ids and the given queue and running limits.
fn generator(eos: Vec<u32>, max_queue: usize, max_running: usize) -> Local {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let files = ModelFiles::open(&tiny()).unwrap();
    let model = files.config().unwrap();
    let config = PipelineConfig {
        max_queue,
        max_running,
        ..PipelineConfig::new(tiny().display().to_string(), &model, eos)
    };
    let generator = {
        let _in = rt.enter();
        local::start(config, &tiny(), &LocalStageOptions::default()).unwrap()
    };
    let start = Instant::now();
    while !generator.ready() {
        assert!(start.elapsed() < DEADLINE, "the in-process stage was not ready in time");
        std::thread::sleep(Duration::from_millis(5));
    }
    Local { generator, rt }
}

fn request(prompt: &[u32], params: SamplingParams) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        params,
        top_logprobs: 0,
        logprobs: false,
    }
}

/// Every event until the end; fails after [`DEADLINE`] rather than waiting forever.
fn drain(g: &Local, mut rx: mpsc::Receiver<TokenEvent>) -> (Vec<TokenEvent>, Option<FinishReason>) {
    let mut events = Vec::new();
    g.rt.block_on(async {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Err(_) => panic!("generation did not finish within {DEADLINE:?}: {events:?}"),
                Ok(Some(TokenEvent::Done { reason })) => return (events, Some(reason)),
                Ok(Some(e @ TokenEvent::Failed { .. })) => panic!("generation failed: {e:?}"),
                Ok(Some(TokenEvent::PromptCached { .. })) => {}
                Ok(Some(e)) => events.push(e),
                Ok(None) => return (events, None),
            }
        }
    })
}

fn ids(events: &[TokenEvent]) -> Vec<u32> {
    events
        .iter()
        .map(|e| match e {
            TokenEvent::Token { id, .. } => *id,
            other => panic!("unexpected {other:?}"),
        })
        .collect()
}

#[test]
fn interleaved_requests_match_the_reference_engine() {
    let mut engine = Engine::new(weights());
    let sampled = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        seed: Some(7),
        max_tokens: 24,
        ..Default::default()
    };
    let cases = [
        (vec![1, 5, 9, 200, 17], SamplingParams::greedy(20)),
        (vec![1, 300, 2, 44], SamplingParams::greedy(7)),
        (vec![3; 30], sampled),
    ];
    let want: Vec<Vec<u32>> = cases
        .iter()
        .map(|(p, params)| engine.generate(p, params, None, |_| {}).unwrap().tokens)
        .collect();
    // No EOS ids: the reference engine without a tokenizer never stops early either.
    let g = generator(Vec::new(), 64, 8);
    assert!(g.ready());
    let receivers: Vec<_> = cases
        .iter()
        .map(|(p, params)| g.submit(request(p, params.clone())).unwrap())
        .collect();
    for (rx, want) in receivers.into_iter().zip(want) {
        let (events, reason) = drain(&g, rx);
        assert_eq!(ids(&events), want);
        assert_eq!(reason, Some(FinishReason::Length));
    }
}

#[test]
fn eos_and_stop_token_ids_end_with_stop() {
    let prompt = [1, 5, 9, 200, 17];
    let first = Engine::new(weights())
        .generate(&prompt, &SamplingParams::greedy(1), None, |_| {})
        .unwrap()
        .tokens[0];
    let g = generator(vec![first], 64, 8);
    let (events, reason) = drain(&g, g.submit(request(&prompt, SamplingParams::greedy(10))).unwrap());
    assert_eq!((ids(&events), reason), (vec![first], Some(FinishReason::Stop)));

    let ignore = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(3)
    };
    let (events, reason) = drain(&g, g.submit(request(&prompt, ignore)).unwrap());
    assert_eq!((events.len(), reason), (3, Some(FinishReason::Length)));

    let g = generator(Vec::new(), 64, 8);
    let stop_id = SamplingParams {
        stop_token_ids: vec![first],
        ..SamplingParams::greedy(10)
    };
    let (events, reason) = drain(&g, g.submit(request(&prompt, stop_id)).unwrap());
    assert_eq!((ids(&events), reason), (vec![first], Some(FinishReason::Stop)));
}

#[test]
fn logprobs_are_the_log_softmax_of_the_logits() {
    let prompt = [1, 5, 9, 200, 17];
    let logits = Engine::new(weights()).prompt_logits(&prompt, false).unwrap();
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&x| ((x - max) as f64).exp()).sum::<f64>().ln() as f32;
    let mut ranked: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l - lse)).collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));

    let g = generator(Vec::new(), 64, 8);
    let req = GenerationRequest {
        top_logprobs: 5,
        logprobs: true,
        ..request(&prompt, SamplingParams::greedy(2))
    };
    let (events, _) = drain(&g, g.submit(req).unwrap());
    let TokenEvent::Token { id, logprobs: Some(lp) } = &events[0] else {
        panic!("no logprobs: {events:?}");
    };
    assert_eq!(*id, ranked[0].0, "greedy picks the most likely token");
    assert!((lp.logprob - ranked[0].1).abs() < 1e-4);
    assert_eq!(lp.top.len(), 5);
    for (got, want) in lp.top.iter().zip(&ranked) {
        assert_eq!(got.0, want.0);
        assert!((got.1 - want.1).abs() < 1e-4, "{got:?} vs {want:?}");
    }
    let TokenEvent::Token {
        logprobs: Some(lp2), ..
    } = &events[1]
    else {
        panic!("no logprobs on the second token");
    };
    assert!(lp2.logprob <= 0.0 && lp2.top.len() == 5);
}

#[test]
fn invalid_requests_are_rejected() {
    let g = generator(Vec::new(), 64, 8);
    let invalid = |req: GenerationRequest| matches!(g.submit(req), Err(SubmitError::Invalid(_)));
    assert!(invalid(request(&[], SamplingParams::greedy(4))));
    assert!(invalid(request(&[1, 320], SamplingParams::greedy(4))));
    assert!(invalid(request(&[1; 200], SamplingParams::greedy(57))));
    assert!(invalid(request(&[1], SamplingParams::greedy(0))));
    let hot = SamplingParams {
        temperature: -1.0,
        ..SamplingParams::greedy(4)
    };
    assert!(invalid(request(&[1], hot)));
    // Exactly filling the context is fine.
    let (events, reason) = drain(&g, g.submit(request(&[1; 200], SamplingParams::greedy(56))).unwrap());
    assert_eq!((events.len(), reason), (56, Some(FinishReason::Length)));
}

#[test]
fn a_full_queue_overloads_and_cancelled_requests_free_their_slot() {
    let g = generator(Vec::new(), 1, 1);
    let long = SamplingParams::greedy(240);
    let mut held = Vec::new();
    let mut overloaded = false;
    for _ in 0..4 {
        match g.submit(request(&[1, 2, 3], long.clone())) {
            Ok(rx) => held.push(rx),
            Err(SubmitError::Overloaded(_)) => overloaded = true,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        overloaded,
        "one running plus one queued request must fill the generator"
    );
    // Dropping the receivers cancels those requests, so new ones get through.
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(30);
    let rx = loop {
        match g.submit(request(&[1, 2, 3], SamplingParams::greedy(3))) {
            Ok(rx) => break rx,
            Err(SubmitError::Overloaded(_)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("{e}"),
        }
    };
    let (events, reason) = drain(&g, rx);
    assert_eq!((events.len(), reason), (3, Some(FinishReason::Length)));
}

#[test]
fn a_model_it_cannot_load_is_a_clear_error() {
    let rt = Runtime::new().unwrap();
    let _in = rt.enter();
    let files = ModelFiles::open(&tiny()).unwrap();
    let model = files.config().unwrap();
    let config = PipelineConfig::new("missing", &model, Vec::new());
    let missing = tiny().join("no-such-model");
    let e = local::start(config.clone(), &missing, &LocalStageOptions::default()).err();
    assert!(
        matches!(&e, Some(LocalError::Open { path, .. }) if path == &missing),
        "{e:?}"
    );
    let tiny_budget = LocalStageOptions {
        kv_budget_bytes: 100,
        ..LocalStageOptions::default()
    };
    let e = local::start(config.clone(), &tiny(), &tiny_budget).err();
    assert!(matches!(e, Some(LocalError::KvBudget { budget: 100, .. })), "{e:?}");
    let no_blocks = LocalStageOptions {
        kv_max_blocks: Some(0),
        ..LocalStageOptions::default()
    };
    let e = local::start(config, &tiny(), &no_blocks).err();
    assert!(matches!(e, Some(LocalError::ZeroKvGeometry)), "{e:?}");
}

#[test]
fn sequences_share_micro_batches_and_reuse_cached_prefixes() {
    // Eight greedy requests with one 40-token prefix at once: the step loop batches them and
    // later ones reuse the first's full blocks; every output equals its sequence alone.
    let mut engine = Engine::new(weights());
    let prompts: Vec<Vec<u32>> = (0..8u32)
        .map(|i| (1..=40).chain([100 + i, 7, 9 + i]).collect())
        .collect();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            engine
                .generate(p, &SamplingParams::greedy(12), None, |_| {})
                .unwrap()
                .tokens
        })
        .collect();
    let g = generator(Vec::new(), 64, 8);
    let (first, _) = drain(&g, g.submit(request(&prompts[0], SamplingParams::greedy(12))).unwrap());
    assert_eq!(ids(&first), want[0]);
    let receivers: Vec<_> = prompts[1..]
        .iter()
        .map(|p| g.submit(request(p, SamplingParams::greedy(12))).unwrap())
        .collect();
    for (rx, want) in receivers.into_iter().zip(&want[1..]) {
        let (events, reason) = drain(&g, rx);
        assert_eq!(&ids(&events), want);
        assert_eq!(reason, Some(FinishReason::Length));
    }
    let view = g.describe();
    assert_eq!(view["mode"], "in-process", "{view}");
    assert!(
        view["prefix_cache"]["hit_tokens_total"].as_u64().unwrap() >= 7 * 32,
        "the later prompts reuse two full blocks each: {view}"
    );
    let steps = view["steps_completed"].as_u64().unwrap();
    assert!(
        steps < 7 * 12,
        "seven requests of 12 tokens took {steps} micro-batches: they were not batched"
    );
}
