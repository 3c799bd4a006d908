//! Speculative decoding through real worker processes: decode steps carry proposals, the last
//! stage verifies them and every stage drops the rejected positions' K/V. Output must equal
//! plain decoding token for token (greedy, and seeded sampling too) through 1, 2 and 3 stages,
//! under concurrency with preemption and prefix-cache hits, with the n-gram drafter, with a
//! random-weight DFlash draft on the last stage (its taps crossing stages as partial sums) and
//! with a drafter that proposes the model's own continuation (every proposal accepted).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use baton_coordinator::pipeline::PipelineStatus;
use baton_coordinator::speculative::{DraftMethod, Drafter, SpeculativeConfig};
use baton_shared::model_files::ModelFiles;
use baton_shared::sampling::SamplingParams;
use baton_tests::cluster::{Limits, TestCluster};
use baton_tests::{PATIENCE, fixtures};
use baton_worker::engine::Engine;
use baton_worker::model::StageWeights;

/// Proposes the continuation of whichever known sequence the tokens so far begin: what the
/// model itself generates, so every proposal is accepted.
struct Oracle(Arc<Vec<Vec<u32>>>);

impl Drafter for Oracle {
    fn method(&self) -> DraftMethod {
        DraftMethod::Ngram
    }

    fn propose(&mut self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        if let Some(full) = self.0.iter().find(|f| f.len() > tokens.len() && f.starts_with(tokens)) {
            out.extend(full[tokens.len()..].iter().take(k));
        }
    }
}

fn oracle(k: usize, sequences: Vec<Vec<u32>>) -> SpeculativeConfig {
    let sequences = Arc::new(sequences);
    SpeculativeConfig {
        custom: Some(Arc::new(move || {
            Box::new(Oracle(sequences.clone())) as Box<dyn Drafter>
        })),
        ..SpeculativeConfig::new(DraftMethod::Ngram, k)
    }
}

/// The random-weight DFlash draft the fixture script writes for the tiny models' shape (taps
/// of layers 0 and 1, hidden 64), drafting `k` tokens a step.
fn dflash(k: usize) -> SpeculativeConfig {
    SpeculativeConfig::dflash(fixtures().join("tiny/qwen3_dflash").display().to_string(), k)
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

/// Prompts that repeat themselves (so prompt lookup finds matches) and some that do not.
fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for s in 0..4u32 {
        let phrase: Vec<u32> = (0..5).map(|i| (s * 41 + i * 13 + 7) % vocab).collect();
        let mut p = Vec::new();
        for _ in 0..3 + s {
            p.extend(&phrase);
        }
        out.push(p);
        out.push((0..3 + 5 * s).map(|i| (s * 97 + i * 29 + 11) % vocab).collect());
    }
    out
}

fn reference(dir: &std::path::Path, prompts: &[Vec<u32>], params: &SamplingParams) -> Vec<Vec<u32>> {
    let files = ModelFiles::open(dir).unwrap();
    let cfg = files.config().unwrap();
    let mut engine = Engine::new(StageWeights::load_full(&files, &cfg, true).unwrap());
    prompts
        .iter()
        .map(|p| engine.generate(p, params, None, |_| {}).unwrap().tokens)
        .collect()
}

fn spec_counts(status: &PipelineStatus) -> (u64, u64, u64) {
    (
        status.spec_steps.load(Ordering::Relaxed),
        status.spec_proposed_tokens.load(Ordering::Relaxed),
        status.spec_accepted_tokens.load(Ordering::Relaxed),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_speculative_output_equals_plain_through_one_two_and_three_stages() {
    let dir = fixtures().join("tiny/qwen3");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let prompts = prompts(cfg.vocab_size as u32);
    let params = greedy(16);
    let want = reference(&dir, &prompts, &params);
    let full: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&want)
        .map(|(p, w)| [p.clone(), w.clone()].concat())
        .collect();
    let mut dflash_counts = None;
    for cuts in [&[][..], &[1], &[1, 2]] {
        // n-gram drafting, all prompts at once.
        let ngram = SpeculativeConfig::new(DraftMethod::Ngram, 4);
        let tc = TestCluster::start_speculative(&dir, &cfg, vec![], cuts, Limits::default(), ngram).await;
        let got = futures::future::join_all(prompts.iter().map(|p| tc.generate(p, params.clone()))).await;
        for (i, (g, w)) in got.into_iter().zip(&want).enumerate() {
            assert_eq!(&g.unwrap().0, w, "n-gram, cuts {cuts:?}, prompt {i}");
        }
        let (steps, proposed, accepted) = spec_counts(&tc.generator.status);
        assert!(
            steps > 0 && proposed > 0,
            "cuts {cuts:?}: the repeated prompts were drafted for"
        );
        assert!(accepted <= proposed);
        drop(tc);

        // A random-weight DFlash draft on the last stage, fed by taps from every stage; one
        // request at a time, so each step's batch is the same whatever the split. The draft
        // then sees the same context (up to summation order) through every split, so it
        // proposes the same tokens: the same counts of proposals and acceptances.
        let tc = TestCluster::start_speculative(&dir, &cfg, vec![], cuts, Limits::default(), dflash(3)).await;
        for (i, (p, w)) in prompts.iter().zip(&want).enumerate() {
            assert_eq!(
                &tc.generate(p, params.clone()).await.unwrap().0,
                w,
                "dflash, cuts {cuts:?}, prompt {i}"
            );
        }
        let counts = spec_counts(&tc.generator.status);
        let (steps, proposed, accepted) = counts;
        assert!(steps > 0 && proposed > 0, "cuts {cuts:?}: the draft proposed tokens");
        assert!(accepted <= proposed);
        eprintln!("dflash, cuts {cuts:?}: {steps} verify steps, {proposed} proposed, {accepted} accepted");
        match dflash_counts {
            None => dflash_counts = Some(counts),
            Some(one_stage) => assert_eq!(counts, one_stage, "dflash through cuts {cuts:?} against one stage"),
        }
        drop(tc);

        // The model's own continuation, one request at a time: every verify step emits k + 1.
        let tc =
            TestCluster::start_speculative(&dir, &cfg, vec![], cuts, Limits::default(), oracle(4, full.clone())).await;
        for (i, (p, w)) in prompts.iter().zip(&want).enumerate() {
            let before = spec_counts(&tc.generator.status);
            let (got, _) = tc.generate(p, params.clone()).await.unwrap();
            assert_eq!(&got, w, "oracle, cuts {cuts:?}, prompt {i}");
            let after = spec_counts(&tc.generator.status);
            let (steps, proposed, accepted) = (after.0 - before.0, after.1 - before.1, after.2 - before.2);
            // 16 tokens: the first from the prompt, then three verify steps of 4 + 1, then
            // max_tokens leaves room for no proposal.
            assert_eq!((steps, proposed, accepted), (3, 12, 12), "cuts {cuts:?}, prompt {i}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_speculative_streams_with_preemption_and_prefix_hits_equal_plain() {
    let dir = fixtures().join("tiny/llama_tied");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let vocab = cfg.vocab_size as u32;
    // Sixteen prompts over two repeated 40-token stems with their own tails; a pool of 14
    // blocks holds about three sequences, so sequences are preempted and stems reused.
    let stems: Vec<Vec<u32>> = (0..2u32)
        .map(|s| {
            let phrase: Vec<u32> = (0..8).map(|i| (s * 977 + i * 131) % vocab).collect();
            phrase.iter().cycle().take(40).copied().collect()
        })
        .collect();
    let cases: Vec<Vec<u32>> = (0..16u32)
        .map(|i| {
            let mut p = stems[i as usize % 2].clone();
            p.extend((0..1 + i % 7).map(|j| (i * 31 + j * 17 + 5) % vocab));
            p
        })
        .collect();
    let params = greedy(24);
    let want = reference(&dir, &cases, &params);
    let full: Vec<Vec<u32>> = cases
        .iter()
        .zip(&want)
        .map(|(p, w)| [p.clone(), w.clone()].concat())
        .collect();
    let limits = Limits {
        kv_max_blocks: Some(14),
        max_running: 16,
        heartbeat: Duration::from_secs(1),
        ..Limits::default()
    };
    for (name, speculative) in [
        ("n-gram", SpeculativeConfig::new(DraftMethod::Ngram, 4)),
        ("oracle", oracle(4, full.clone())),
        ("dflash", dflash(4)),
    ] {
        let tc = TestCluster::start_speculative(&dir, &cfg, vec![], &[1], limits, speculative).await;
        let runs = cases.iter().map(|p| tc.generate(p, params.clone()));
        let got = tokio::time::timeout(2 * PATIENCE, futures::future::join_all(runs))
            .await
            .expect("every stream finished");
        for (i, (g, w)) in got.into_iter().zip(&want).enumerate() {
            assert_eq!(&g.unwrap().0, w, "{name}: stream {i}");
        }
        let status = &tc.generator.status;
        let (_, proposed, accepted) = spec_counts(status);
        assert!(proposed > 0, "{name}: proposals were made");
        if name == "oracle" {
            assert_eq!(accepted, proposed, "the model's own continuation is always accepted");
        }
        assert!(
            status.preemptions.load(Ordering::Relaxed) > 0,
            "{name}: the pool was too small"
        );
        assert!(
            status.prefix_hit_tokens.load(Ordering::Relaxed) > 0,
            "{name}: stems were reused"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_is_unchanged_by_speculation() {
    // A verified draft draws each token exactly as plain decoding would (one draw per token
    // from the same random stream over the same logits), so a seeded request is reproduced
    // token for token, whatever was proposed.
    let dir = fixtures().join("tiny/qwen3_moe");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let prompts = prompts(cfg.vocab_size as u32);
    let sampled = |seed| SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(seed),
        ignore_eos: true,
        ..SamplingParams::greedy(20)
    };
    let plain = TestCluster::start(&dir, &cfg, vec![], &[2]).await;
    let mut want = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        want.push(plain.generate(p, sampled(i as u64)).await.unwrap().0);
    }
    drop(plain);
    let full: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&want)
        .map(|(p, w)| [p.clone(), w.clone()].concat())
        .collect();
    for (name, speculative) in [
        ("n-gram", SpeculativeConfig::new(DraftMethod::Ngram, 3)),
        ("oracle", oracle(3, full)),
        ("dflash", dflash(3)),
    ] {
        let tc = TestCluster::start_speculative(&dir, &cfg, vec![], &[2], Limits::default(), speculative).await;
        let runs = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| tc.generate(p, sampled(i as u64)));
        for (i, (g, w)) in futures::future::join_all(runs).await.into_iter().zip(&want).enumerate() {
            assert_eq!(&g.unwrap().0, w, "{name}: prompt {i}");
        }
        let (_, proposed, accepted) = spec_counts(&tc.generator.status);
        assert!(proposed > 0, "{name}");
        if name == "oracle" {
            assert_eq!(accepted, proposed);
        }
    }
}

/// Run `n` sampled requests for `prompt` on the tiny model in this process with `speculative`,
/// seeds from `seed0`; each request's tokens and the verify counts.
async fn sample_many(
    dir: &std::path::Path,
    prompt: &[u32],
    params: impl Fn(u64) -> SamplingParams,
    speculative: SpeculativeConfig,
    seeds: std::ops::Range<u64>,
) -> (Vec<Vec<u32>>, (u64, u64, u64)) {
    use baton_coordinator::local::{self, LocalStageOptions};
    use baton_coordinator::pipeline::PipelineConfig;
    use baton_tests::cluster::generate_on;
    let cfg = ModelFiles::open(dir).unwrap().config().unwrap();
    let config = PipelineConfig {
        max_running: 16,
        max_queue: 4096,
        speculative,
        ..PipelineConfig::new(dir.display().to_string(), &cfg, vec![])
    };
    let generator = local::start(config, dir, &LocalStageOptions::default()).unwrap();
    generator.wait_ready(PATIENCE).await.unwrap();
    let generator = &generator;
    let runs = seeds.map(|seed| {
        let params = params(seed);
        async move { generate_on(generator, prompt, params).await.unwrap().0 }
    });
    let out = futures::future::join_all(runs).await;
    (out, spec_counts(&generator.status))
}

/// Pearson's statistic for two samples of categories being drawn from one distribution,
/// categories with fewer than 10 observations in both pooled into one; and its degrees of
/// freedom.
fn two_sample_chi_square(a: &[u32], b: &[u32]) -> (f64, usize) {
    use std::collections::BTreeMap;
    let mut counts: BTreeMap<u32, (f64, f64)> = BTreeMap::new();
    for &t in a {
        counts.entry(t).or_default().0 += 1.0;
    }
    for &t in b {
        counts.entry(t).or_default().1 += 1.0;
    }
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut rare = (0.0, 0.0);
    for (_, (x, y)) in counts {
        if x + y < 10.0 {
            rare = (rare.0 + x, rare.1 + y);
        } else {
            cells.push((x, y));
        }
    }
    if rare.0 + rare.1 > 0.0 {
        cells.push(rare);
    }
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let stat = cells
        .iter()
        .map(|&(x, y)| {
            let total = x + y;
            let (ea, eb) = (total * na / (na + nb), total * nb / (na + nb));
            (x - ea).powi(2) / ea + (y - eb).powi(2) / eb
        })
        .sum();
    (stat, cells.len().saturating_sub(1))
}

/// The 99.9th percentile of chi-square with `dof` degrees of freedom (Wilson–Hilferty, within
/// a few percent for dof ≥ 2).
fn chi_square_999(dof: usize) -> f64 {
    let k = dof as f64;
    let z = 3.090;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
fn the_chi_square_percentile_is_right_where_tabulated() {
    for (dof, table) in [(2, 13.82), (5, 20.52), (10, 29.59), (24, 51.18)] {
        let got = chi_square_999(dof);
        assert!((got - table).abs() / table < 0.03, "{dof}: {got} vs {table}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_speculative_output_keeps_the_models_distribution() {
    // Different seeds on each side, so the two samples are independent draws: with
    // speculation the tokens must follow the same distribution as without (a verify step that
    // favoured or disfavoured the proposal would shift the proposed token's share).
    let dir = fixtures().join("tiny/llama_tied");
    let prompt = [5u32, 17, 200, 3, 99];
    let likely = reference(&dir, &[prompt.to_vec()], &greedy(3))[0].clone();
    let params = |seed| SamplingParams {
        temperature: 0.7,
        top_k: 6,
        seed: Some(seed),
        ignore_eos: true,
        ..SamplingParams::greedy(3)
    };
    /// Always proposes the greedy path's second and third tokens.
    struct Fixed(Vec<u32>);
    impl Drafter for Fixed {
        fn method(&self) -> DraftMethod {
            DraftMethod::Ngram
        }
        fn propose(&mut self, _tokens: &[u32], k: usize, out: &mut Vec<u32>) {
            out.extend(self.0.iter().take(k));
        }
    }
    let fixed = likely[1..].to_vec();
    let speculative = SpeculativeConfig {
        custom: Some(Arc::new(move || Box::new(Fixed(fixed.clone())) as Box<dyn Drafter>)),
        ..SpeculativeConfig::new(DraftMethod::Ngram, 2)
    };
    let n = 600;
    let (plain, _) = sample_many(&dir, &prompt, params, SpeculativeConfig::OFF, 0..n).await;
    let (spec, (steps, proposed, accepted)) = sample_many(&dir, &prompt, params, speculative, n..2 * n).await;
    assert!(
        steps > 0 && accepted > 0 && accepted < proposed,
        "{steps} steps, {accepted} of {proposed} accepted"
    );
    for position in 1..3 {
        let a: Vec<u32> = plain.iter().map(|t| t[position]).collect();
        let b: Vec<u32> = spec.iter().map(|t| t[position]).collect();
        let (stat, dof) = two_sample_chi_square(&a, &b);
        assert!(dof >= 2, "token {position}: {dof} degrees of freedom");
        let limit = chi_square_999(dof);
        assert!(
            stat < limit,
            "token {position}: chi-square {stat:.1} with {dof} degrees of freedom (99.9th percentile {limit:.1})"
        );
    }
    // The same test tells a biased sampler apart: always accepting the proposal.
    let a: Vec<u32> = plain.iter().map(|t| t[1]).collect();
    let biased: Vec<u32> = vec![likely[1]; n as usize];
    assert!(two_sample_chi_square(&a, &biased).0 > 100.0);
}
