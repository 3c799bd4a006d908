//! The in-process generator on a tiny fixture model: same tokens as the reference engine even
//! when requests interleave, stop conditions, logprobs, validation, queue limits, cancellation.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use baton_coordinator::generation::{FinishReason, GenerationRequest, Generator, SubmitError, TokenEvent};
use baton_coordinator::local::{LocalConfig, LocalError, LocalGenerator};
use baton_shared::model_files::ModelFiles;
use baton_shared::sampling::SamplingParams;
use baton_worker::engine::Engine;
use baton_worker::model::StageWeights;
use tokio::sync::mpsc;

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny/llama_tied")
}

fn weights() -> StageWeights {
    let files = ModelFiles::open(&tiny()).unwrap();
    let config = files.config().unwrap();
    StageWeights::load_full(&files, &config, true).unwrap()
}

fn generator(eos: Vec<u32>, config: LocalConfig) -> LocalGenerator {
    LocalGenerator::new(weights(), eos, config).unwrap()
}

fn request(prompt: &[u32], params: SamplingParams) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        params,
        top_logprobs: 0,
        logprobs: false,
    }
}

/// Every event until the end (bounded in time).
fn drain(mut rx: mpsc::Receiver<TokenEvent>) -> (Vec<TokenEvent>, Option<FinishReason>) {
    let mut events = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        match rx.blocking_recv() {
            Some(TokenEvent::Done { reason }) => return (events, Some(reason)),
            Some(e @ TokenEvent::Failed { .. }) => panic!("generation failed: {e:?}"),
            Some(e) => events.push(e),
            None => return (events, None),
        }
    }
    panic!("generation did not finish");
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
    let g = generator(Vec::new(), LocalConfig::default());
    assert!(g.ready());
    let receivers: Vec<_> = cases
        .iter()
        .map(|(p, params)| g.submit(request(p, params.clone())).unwrap())
        .collect();
    for (rx, want) in receivers.into_iter().zip(want) {
        let (events, reason) = drain(rx);
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
    let g = generator(vec![first], LocalConfig::default());
    let (events, reason) = drain(g.submit(request(&prompt, SamplingParams::greedy(10))).unwrap());
    assert_eq!((ids(&events), reason), (vec![first], Some(FinishReason::Stop)));

    let ignore = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(3)
    };
    let (events, reason) = drain(g.submit(request(&prompt, ignore)).unwrap());
    assert_eq!((events.len(), reason), (3, Some(FinishReason::Length)));

    let g = generator(Vec::new(), LocalConfig::default());
    let stop_id = SamplingParams {
        stop_token_ids: vec![first],
        ..SamplingParams::greedy(10)
    };
    let (events, reason) = drain(g.submit(request(&prompt, stop_id)).unwrap());
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

    let g = generator(Vec::new(), LocalConfig::default());
    let req = GenerationRequest {
        top_logprobs: 5,
        logprobs: true,
        ..request(&prompt, SamplingParams::greedy(2))
    };
    let (events, _) = drain(g.submit(req).unwrap());
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
    let g = generator(Vec::new(), LocalConfig::default());
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
    let (events, reason) = drain(g.submit(request(&[1; 200], SamplingParams::greedy(56))).unwrap());
    assert_eq!((events.len(), reason), (56, Some(FinishReason::Length)));
}

#[test]
fn a_full_queue_overloads_and_cancelled_requests_free_their_slot() {
    let config = LocalConfig {
        max_queue: 1,
        max_running: 1,
    };
    let g = generator(Vec::new(), config);
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
    let (events, reason) = drain(rx);
    assert_eq!((events.len(), reason), (3, Some(FinishReason::Length)));
}

#[test]
fn needs_the_whole_model_and_nonzero_limits() {
    let files = ModelFiles::open(&tiny()).unwrap();
    let config = files.config().unwrap();
    let partial = StageWeights::load(&files, &config, 0..1, true, false, true).unwrap();
    let e = LocalGenerator::new(partial, Vec::new(), LocalConfig::default()).err();
    assert!(matches!(e, Some(LocalError::NotFullModel)), "{e:?}");
    let zero = LocalConfig {
        max_queue: 0,
        max_running: 1,
    };
    let e = LocalGenerator::new(weights(), Vec::new(), zero).err();
    assert!(matches!(e, Some(LocalError::ZeroLimit)), "{e:?}");
}
