//! Prefix caching through a real pipeline: a prompt that starts with blocks an earlier request
//! computed reuses their K/V on every stage, prefills only the rest, and generates exactly
//! what it generates alone.

use std::sync::atomic::Ordering;
use std::time::Duration;

use baton_shared::model_files::ModelFiles;
use baton_shared::model_source::LoadedModel;
use baton_shared::sampling::SamplingParams;
use baton_tests::cluster::{Limits, TestCluster};
use baton_tests::{PATIENCE, default_model, fixtures, wait_until_async};
use baton_worker::engine::Engine;
use baton_worker::model::StageWeights;

const BLOCK: usize = 16;

fn greedy(max: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max)
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Positions a prompt reuses when `cached` of its leading tokens are in full cached blocks:
/// whole blocks only, and never its last position.
fn expected_reuse(cached: usize, prompt_len: usize) -> usize {
    cached.min(prompt_len - 1) / BLOCK * BLOCK
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prompts_and_later_turns_reuse_cached_blocks_without_changing_output() {
    let model = default_model();
    let loaded = LoadedModel::open(&model).unwrap();
    let tok = &loaded.tokenizer;
    let system = "You are a careful assistant for a small bakery. Answer in one short sentence, \
                  mention the opening hours when it helps, and never invent prices. The bakery \
                  opens at seven and closes at six, and it is closed on Mondays.";
    let questions = [
        "When can I buy bread on Tuesday?",
        "Do you sell cakes?",
        "Is the shop open on Monday?",
        "What time do you close?",
        "Can I order ahead?",
    ];
    let prompts: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| tok.encode(&format!("{system}\nQuestion: {q}\nAnswer:"), true).unwrap())
        .collect();
    let files = ModelFiles::open(&model).unwrap();
    let mut engine = Engine::new(StageWeights::load_full(&files, &loaded.config, true).unwrap());
    let mut solo = |p: &[u32], max| engine.generate(p, &greedy(max), None, |_| {}).unwrap().tokens;
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| solo(p, 12)).collect();
    // A second turn: the first exchange, its answer, and a follow-up.
    let mut turn2 = prompts[0].clone();
    turn2.extend(&want[0]);
    turn2.extend(tok.encode("\nQuestion: And on Sunday?\nAnswer:", false).unwrap());
    let want_turn2 = solo(&turn2, 12);

    let limits = Limits {
        heartbeat: Duration::from_secs(2),
        ..Limits::default()
    };
    let tc = TestCluster::start_full(&model, &loaded.config, tok.eos_ids.clone(), &[15], &[], limits).await;
    let status = tc.generator.status.clone();
    let hits = || status.prefix_hit_tokens.load(Ordering::Relaxed) as usize;

    // The first request finds nothing cached.
    assert_eq!(tc.generate(&prompts[0], greedy(12)).await.unwrap().0, want[0]);
    assert_eq!(hits(), 0);
    // Its full blocks are indexed as its micro-batches come back (published right after the
    // tokens are handed out).
    wait_until_async("the first prompt's full blocks are indexed", || async {
        let cached = status.kv_blocks_cached.load(Ordering::Relaxed);
        if cached >= (prompts[0].len() / BLOCK) as u64 {
            Ok(())
        } else {
            Err(format!("{cached} cached"))
        }
    })
    .await;

    // The second shares the system prompt: every full block of it is reused.
    let shared = common_prefix(&prompts[0], &prompts[1]);
    assert!(
        shared >= 2 * BLOCK,
        "the test needs a prefix of several blocks ({shared})"
    );
    assert_eq!(tc.generate(&prompts[1], greedy(12)).await.unwrap().0, want[1]);
    assert_eq!(hits(), expected_reuse(shared, prompts[1].len()));

    // The same prompt again reuses all its full blocks but the one with its last position.
    let before = hits();
    assert_eq!(tc.generate(&prompts[1], greedy(12)).await.unwrap().0, want[1]);
    assert_eq!(hits() - before, expected_reuse(prompts[1].len(), prompts[1].len()));

    // Three at once, all sharing the prefix.
    let before = hits();
    let runs = prompts[2..].iter().map(|p| tc.generate(p, greedy(12)));
    let got = futures::future::join_all(runs).await;
    for (i, g) in got.into_iter().enumerate() {
        assert_eq!(g.unwrap().0, want[i + 2], "concurrent request {i} with a reused prefix");
    }
    let at_least: usize = prompts[2..]
        .iter()
        .map(|p| expected_reuse(common_prefix(&prompts[0], p), p.len()))
        .sum();
    assert!(hits() - before >= at_least, "{} < {at_least}", hits() - before);

    // A later turn reuses the blocks the first request's generated tokens filled too (all but
    // its last token, whose K/V was never computed).
    let before = hits();
    assert_eq!(tc.generate(&turn2, greedy(12)).await.unwrap().0, want_turn2);
    let first_computed = prompts[0].len() + want[0].len() - 1;
    assert_eq!(hits() - before, expected_reuse(first_computed, turn2.len()));
    assert!(
        hits() - before > prompts[0].len() / BLOCK * BLOCK,
        "generated tokens' blocks were reused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_pool_evicts_cached_blocks_and_preempts_without_changing_any_output() {
    // A dense model and a mixture of experts (whose rows are regrouped by expert in every
    // micro-batch).
    for name in ["llama_tied", "qwen3_moe_dense_mix"] {
        let dir = fixtures().join("tiny").join(name);
        let files = ModelFiles::open(&dir).unwrap();
        let cfg = files.config().unwrap();
        let vocab = cfg.vocab_size as u32;
        // Twelve prompts over two 40-token stems with their own tails; 24 generated tokens each.
        // The pool of 12 blocks holds about three sequences, so cached blocks are evicted for new
        // ones and running sequences are preempted, with hits from whatever is still cached.
        let stems: Vec<Vec<u32>> = (0..2u32)
            .map(|s| (0..40).map(|i| (s * 977 + i * 131) % vocab).collect())
            .collect();
        let cases: Vec<Vec<u32>> = (0..12u32)
            .map(|i| {
                let mut p = stems[i as usize % 2].clone();
                p.extend((0..1 + i % 7).map(|j| (i * 31 + j * 17 + 5) % vocab));
                p
            })
            .collect();
        let mut engine = Engine::new(StageWeights::load_full(&files, &cfg, true).unwrap());
        let solo: Vec<Vec<u32>> = cases
            .iter()
            .map(|p| engine.generate(p, &greedy(24), None, |_| {}).unwrap().tokens)
            .collect();
        let limits = Limits {
            kv_max_blocks: Some(12),
            heartbeat: Duration::from_secs(1),
            ..Limits::default()
        };
        let tc = TestCluster::start_full(&dir, &cfg, vec![], &[1], &[], limits).await;
        // Two waves, so the second finds the first's blocks cached (or evicted).
        for wave in cases.chunks(6).zip(solo.chunks(6)) {
            let runs = wave.0.iter().map(|p| tc.generate(p, greedy(24)));
            // A scheduler that stops making progress fails here instead of hanging the suite.
            let got = tokio::time::timeout(2 * PATIENCE, futures::future::join_all(runs))
                .await
                .expect("every request of the wave finished");
            for (i, (g, want)) in got.into_iter().zip(wave.1).enumerate() {
                assert_eq!(
                    &g.unwrap().0,
                    want,
                    "{name}: request {i} changed by prefix reuse in a tiny pool"
                );
            }
        }
        let status = &tc.generator.status;
        assert!(
            status.prefix_hit_tokens.load(Ordering::Relaxed) > 0,
            "stems were reused"
        );
        assert!(
            status.preemptions.load(Ordering::Relaxed) > 0,
            "the pool was too small for all"
        );
        assert!(status.kv_blocks_cached.load(Ordering::Relaxed) <= 12);
        // Every block is free again (cached ones count as free: any allocation may take them).
        wait_until_async("every KV block is returned", || async {
            match status.kv_blocks_used.load(Ordering::Relaxed) {
                0 => Ok(()),
                used => Err(format!("{used} blocks in use")),
            }
        })
        .await;
    }
}
