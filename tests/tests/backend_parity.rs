//! The transformers fixtures through the [`Backend`] trait, the interface every stage runs on,
//! for each device this build can run (`cpu` at one and two threads here; a build with another
//! backend adds its devices to [`devices`] and is held to the same checks): fp32 logits within
//! 1e-4 at every position with the prompt prefilled in chunks over paged KV, and stage splits
//! bit-identical to one stage.

use std::ops::Range;

use baton_shared::model_files::ModelFiles;
use baton_tests::{f32s, fixtures, ids, max_abs_diff, read_json};
use baton_worker::backend::{self, Backend, BackendOptions, CpuOptions, Device, SeqChunk};
use baton_worker::kv_cache::KvDtype;
use baton_worker::model::WeightFormat;

const TOL: f32 = 1e-4;
const TINY: &[&str] = baton_tests::TINY_MODELS;
const BLOCK: usize = 4;

/// Every device to hold to the fixtures, of those this build and machine can run.
fn devices() -> Vec<Device> {
    let candidates = [
        Device::Cpu { threads: Some(1) },
        Device::Cpu { threads: Some(2) },
        Device::Cuda { gpu: 0 },
    ];
    let usable: Vec<Device> = candidates.into_iter().filter(|d| d.check_available().is_ok()).collect();
    assert!(usable.iter().any(|d| d.kind() == "cpu"), "the CPU backend always runs");
    usable
}

fn load(files: &ModelFiles, layers: Range<usize>, device: Device) -> Box<dyn Backend> {
    let cfg = files.config().unwrap();
    let opts = BackendOptions {
        device,
        format: WeightFormat::F32,
        cpu: CpuOptions::threads(1),
        check_finite: true,
        kv_blocks: 64,
        kv_block_size: BLOCK,
        kv_dtype: KvDtype::F32,
        state_slots: 0,
        state_snapshots: 0,
    };
    backend::load(files, &cfg, layers, &opts).unwrap()
}

/// Logits at every position of `tokens`, run through `stages` (consecutive layer ranges) in
/// chunks of `chunk` positions, each chunk attending over the blocks the earlier ones wrote.
fn logits_in_chunks(stages: &mut [Box<dyn Backend>], tokens: &[u32], chunk: usize) -> Vec<f32> {
    let cfg = stages[0].shape().config.clone();
    let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
    // A scattered block table, as the coordinator's allocator hands out after some traffic.
    let table: Vec<u32> = (0..tokens.len().div_ceil(BLOCK) as u32)
        .map(|i| (i * 7 + 3) % 64)
        .collect();
    let mut out = Vec::with_capacity(tokens.len() * vocab);
    for (i, ids) in tokens.chunks(chunk).enumerate() {
        let pos0 = i * chunk;
        let chunks = [SeqChunk {
            pos0,
            len: ids.len(),
            stored: pos0,
            table: &table,
            state_slot: 0,
            prompt_len: 0,
        }];
        let mut hidden = vec![0f32; ids.len() * h];
        stages[0].embed(ids, &mut hidden).unwrap();
        for s in stages.iter_mut() {
            s.forward(&mut hidden, &chunks).unwrap();
        }
        let mut logits = vec![0f32; ids.len() * vocab];
        stages.last_mut().unwrap().logits(&hidden, &mut logits).unwrap();
        out.extend(logits);
    }
    out
}

#[test]
fn tiny_models_match_transformers_through_the_backend_on_every_device() {
    for device in devices() {
        for name in TINY {
            let files = ModelFiles::open(&fixtures().join("tiny").join(name)).unwrap();
            let n = files.config().unwrap().num_layers;
            let reference = read_json(&fixtures().join("tiny").join(name).join("reference.json"));
            let sequences = reference["sequences"].as_array().unwrap();
            assert!(!sequences.is_empty(), "{name}: no reference sequences");
            for (i, seq) in sequences.iter().enumerate() {
                let tokens = ids(&seq["tokens"]);
                let want: Vec<f32> = seq["logits"].as_array().unwrap().iter().flat_map(f32s).collect();
                for chunk in [tokens.len(), 3, 1] {
                    let mut stage = [load(&files, 0..n, device)];
                    let got = logits_in_chunks(&mut stage, &tokens, chunk);
                    assert_eq!(got.len(), want.len(), "{name} sequence {i}");
                    let err = max_abs_diff(&got, &want);
                    assert!(
                        err < TOL,
                        "{device} {name} sequence {i} in chunks of {chunk}: max |logit error| {err}"
                    );
                }
            }
        }
    }
}

#[test]
fn stage_splits_through_the_backend_equal_one_stage_bit_for_bit() {
    for device in devices() {
        for name in ["llama_untied", "qwen2", "qwen3", "qwen3_moe", "qwen3_moe_dense_mix"] {
            let files = ModelFiles::open(&fixtures().join("tiny").join(name)).unwrap();
            let n = files.config().unwrap().num_layers;
            let tokens = [5u32, 17, 200, 3, 99, 42, 7];
            let whole = logits_in_chunks(&mut [load(&files, 0..n, device)], &tokens, 3);
            let mut splits = 0;
            for cuts in [vec![1], vec![n - 1], vec![1, n - 1]] {
                if cuts.iter().any(|&c| c == 0 || c >= n) || cuts.windows(2).any(|w| w[0] >= w[1]) {
                    continue;
                }
                let mut bounds = vec![0];
                bounds.extend(&cuts);
                bounds.push(n);
                let mut stages: Vec<_> = bounds.windows(2).map(|w| load(&files, w[0]..w[1], device)).collect();
                assert!(stages[0].shape().first && stages.last().unwrap().shape().last);
                assert_eq!(
                    logits_in_chunks(&mut stages, &tokens, 3),
                    whole,
                    "{device} {name} split at {cuts:?}"
                );
                splits += 1;
            }
            assert!(splits >= 1, "{name}: {n} layers allow no split");
        }
    }
}

#[test]
fn smollm2_matches_transformers_through_the_backend() {
    let files = ModelFiles::open(&baton_tests::default_model()).unwrap();
    let cfg = files.config().unwrap();
    let fx = read_json(&fixtures().join("smollm2/logits.json"));
    let prompts = fx["prompts"].as_array().unwrap();
    assert!(!prompts.is_empty());
    // One device and a two-stage split: the model is large for a debug test run.
    let device = Device::Cpu { threads: Some(2) };
    let mut stages = [load(&files, 0..15, device), load(&files, 15..cfg.num_layers, device)];
    // Each prompt starts a fresh sequence at position 0 over the same blocks.
    for p in prompts {
        let tokens = ids(&p["ids"]);
        let bytes = std::fs::read(fixtures().join("smollm2").join(p["logits_file"].as_str().unwrap())).unwrap();
        let want: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(
            want.len(),
            cfg.vocab_size,
            "the fixture holds the last position's logits"
        );
        let all = logits_in_chunks(&mut stages, &tokens, 2);
        let got = &all[all.len() - cfg.vocab_size..];
        let err = max_abs_diff(got, &want);
        assert!(err < TOL, "{:?}: max |logit error| {err}", p["text"]);
    }
}

#[test]
fn sampling_on_the_backend_equals_sampling_its_logits_on_the_host() {
    use baton_shared::sampling::SamplingParams;
    use baton_worker::backend::SampleSlot;
    use baton_worker::sampler::{Sampler, log_softmax_top};
    for device in devices() {
        let files = ModelFiles::open(&fixtures().join("tiny").join("qwen3")).unwrap();
        let cfg = files.config().unwrap();
        let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let mut b = load(&files, 0..cfg.num_layers, device);
        let tokens = [5u32, 17, 200, 3];
        let mut rows = vec![0f32; tokens.len() * h];
        b.embed(&tokens, &mut rows).unwrap();
        let table: Vec<u32> = (0..4).collect();
        let chunk = [SeqChunk {
            pos0: 0,
            len: tokens.len(),
            stored: 0,
            table: &table,
            state_slot: 0,
            prompt_len: 0,
        }];
        b.forward(&mut rows, &chunk).unwrap();
        let mut logits = vec![0f32; tokens.len() * vocab];
        b.logits(&rows, &mut logits).unwrap();
        let params = [
            SamplingParams::greedy(1),
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                seed: Some(7),
                ..SamplingParams::default()
            },
        ];
        for p in &params {
            let mut slots: Vec<SampleSlot> = (0..tokens.len())
                .map(|i| SampleSlot::new(Sampler::new(p), (i % 2 == 0).then_some(3)))
                .collect();
            // Two draws each, so the random stream each slot carries is checked too.
            let mut host: Vec<Sampler> = (0..tokens.len()).map(|_| Sampler::new(p)).collect();
            for draw in 0..2 {
                b.sample(&rows, &mut slots).unwrap();
                for (i, (slot, row)) in slots.iter().zip(logits.chunks_exact(vocab)).enumerate() {
                    let want = host[i].sample(row);
                    assert_eq!(slot.token, want, "{device} {p:?} row {i} draw {draw}");
                    if let Some(k) = slot.top_logprobs {
                        let (lp, top) = log_softmax_top(row, want, k);
                        assert_eq!((slot.logprob, &slot.top), (lp, &top), "{device} row {i}");
                    }
                }
            }
        }
        let mut one = [SampleSlot::new(Sampler::new(&params[0]), None)];
        assert!(b.sample(&rows, &mut one).is_err(), "{device}: rows and slots disagree");
    }
}
