//! Batching across sequences: a micro-batch of many sequences runs each weight matrix once for
//! all of them, and nobody's output changes — bit for bit in the kernels, token for token
//! through a pipeline under 16 concurrent requests, some cancelled mid-way.

use std::time::Duration;

use baton_coordinator::generation::{GenerationRequest, Generator, TokenEvent};
use baton_shared::model_files::ModelFiles;
use baton_shared::model_source::LoadedModel;
use baton_shared::sampling::SamplingParams;
use baton_tests::cluster::{Limits, TestCluster};
use baton_tests::{default_model, fixtures};
use baton_worker::backend::{self, Backend, BackendOptions, CpuOptions, Device, SeqChunk};
use baton_worker::engine::Engine;
use baton_worker::kv_cache::SequenceKv;
use baton_worker::kv_cache::{BatchSeq, KvDtype};
use baton_worker::model::{LoadOptions, Scratch, StageWeights, WeightFormat};

/// Deterministic token ids below `vocab`.
fn tokens(seed: u32, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed * 7919 + i * 104729) % vocab as u32)
        .collect()
}

#[test]
fn a_batch_of_sequences_equals_each_sequence_alone_bit_for_bit() {
    for (name, format) in [
        ("llama_tied", WeightFormat::F32),
        ("qwen2", WeightFormat::F32),
        ("qwen3", WeightFormat::F32),
        ("llama_untied", WeightFormat::Q8_0),
        ("qwen3_moe", WeightFormat::F32),
        ("qwen3_moe_dense_mix", WeightFormat::Q4_0),
    ] {
        let files = ModelFiles::open(&fixtures().join("tiny").join(name)).unwrap();
        let cfg = files.config().unwrap();
        let opts = LoadOptions {
            format,
            threads: 2,
            kernels: None,
        };
        let w = StageWeights::load_full_with(&files, &cfg, true, &opts).unwrap();
        let (h, layers, kvd) = (cfg.hidden_size, cfg.num_layers, cfg.kv_dim());
        let embed = |ids: &[u32]| {
            let mut x = vec![0f32; ids.len() * h];
            w.embed(ids, &mut x).unwrap();
            x
        };
        // Step 1: three prompts of different lengths. Step 2: one decode token for each of
        // them plus a new prompt, as a continuous-batching step mixes them.
        let prompts = [5, 3, 7].map(|n| tokens(n as u32, n, cfg.vocab_size));
        let newcomer = tokens(11, 4, cfg.vocab_size);
        let decode = [[17u32], [23], [29]];

        let mut alone_kv: Vec<SequenceKv> = (0..4).map(|_| SequenceKv::new(layers, kvd, 1)).collect();
        let mut scratch = Scratch::default();
        let mut alone_out = Vec::new();
        for (p, kv) in prompts.iter().zip(alone_kv.iter_mut()) {
            let mut x = embed(p);
            w.forward(&mut x, 0, kv, &mut scratch).unwrap();
            alone_out.extend(x);
        }
        let mut alone_step2 = Vec::new();
        for ((d, p), kv) in decode.iter().zip(&prompts).zip(alone_kv.iter_mut()) {
            let mut x = embed(d);
            w.forward(&mut x, p.len(), kv, &mut scratch).unwrap();
            alone_step2.extend(x);
        }
        let mut x = embed(&newcomer);
        w.forward(&mut x, 0, &mut alone_kv[3], &mut scratch).unwrap();
        alone_step2.extend(x);

        let mut kvs: Vec<SequenceKv> = (0..4).map(|_| SequenceKv::new(layers, kvd, 1)).collect();
        let mut scratch = Scratch::default();
        let mut x: Vec<f32> = prompts.iter().flat_map(|p| embed(p)).collect();
        {
            let (a, rest) = kvs.split_at_mut(1);
            let (b, c) = rest.split_at_mut(1);
            let mut batch = [
                BatchSeq {
                    pos0: 0,
                    len: 5,
                    prompt_len: 0,
                    kv: &mut a[0],
                },
                BatchSeq {
                    pos0: 0,
                    len: 3,
                    prompt_len: 0,
                    kv: &mut b[0],
                },
                BatchSeq {
                    pos0: 0,
                    len: 7,
                    prompt_len: 0,
                    kv: &mut c[0],
                },
            ];
            w.forward_batch(&mut x, &mut batch[..], &mut scratch).unwrap();
        }
        assert_eq!(x, alone_out, "{name} {format}: batched prefill");

        let mut x: Vec<f32> = decode.iter().flat_map(|d| embed(d)).chain(embed(&newcomer)).collect();
        let mut batch: Vec<BatchSeq<'_>> = kvs
            .iter_mut()
            .zip([5, 3, 7, 0])
            .map(|(kv, pos0)| BatchSeq {
                pos0,
                len: if pos0 == 0 { 4 } else { 1 },
                prompt_len: 0,
                kv,
            })
            .collect();
        w.forward_batch(&mut x, &mut batch[..], &mut scratch).unwrap();
        assert_eq!(x, alone_step2, "{name} {format}: batched decode + prefill");
        for (a, b) in kvs.iter().zip(&alone_kv) {
            assert_eq!(a.len(), b.len());
            for (la, lb) in a.layers.iter().zip(&b.layers) {
                assert_eq!(la.k[..a.len() * kvd], lb.k[..b.len() * kvd], "{name}: K cache");
                assert_eq!(la.v[..a.len() * kvd], lb.v[..b.len() * kvd], "{name}: V cache");
            }
        }

        // A sequence whose cache does not match its position fails the batch before any
        // cache changes.
        let before: Vec<usize> = kvs.iter().map(SequenceKv::len).collect();
        let mut x = embed(&[1, 2]);
        let (a, b) = kvs.split_at_mut(1);
        let mut bad = [
            BatchSeq {
                pos0: 6,
                len: 1,
                prompt_len: 0,
                kv: &mut a[0],
            },
            BatchSeq {
                pos0: 0,
                len: 1,
                prompt_len: 0,
                kv: &mut b[0],
            },
        ];
        assert!(w.forward_batch(&mut x, &mut bad[..], &mut scratch).is_err());
        assert_eq!(kvs.iter().map(SequenceKv::len).collect::<Vec<_>>(), before);
    }
}

/// The backend a pipeline stage runs on, split in two at every layer boundary: a mixed step
/// (decode tokens of running sequences plus a newcomer's prompt, in scattered KV blocks) gives
/// each sequence the logits it gets alone through the single-process engine, bit for bit.
#[test]
fn backends_split_across_layers_give_each_sequence_its_solo_logits() {
    for (name, format) in [("llama_tied", WeightFormat::F32), ("qwen3", WeightFormat::Q8_0)] {
        let files = ModelFiles::open(&fixtures().join("tiny").join(name)).unwrap();
        let cfg = files.config().unwrap();
        let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let opts = LoadOptions {
            format,
            threads: 2,
            kernels: None,
        };
        let mut engine = Engine::new(StageWeights::load_full_with(&files, &cfg, true, &opts).unwrap());
        let prompts = [6, 2, 9].map(|n| tokens(n as u32 + 40, n, vocab));
        let next = [31u32, 37, 41];
        // Solo: the logits after each prompt, and after its prompt plus one more token.
        let solo: Vec<(Vec<f32>, Vec<f32>)> = prompts
            .iter()
            .zip(next)
            .map(|(p, t)| {
                let mut longer = p.clone();
                longer.push(t);
                let a = engine.prompt_logits(p, false).unwrap();
                let b = engine.prompt_logits(&longer, false).unwrap();
                (a, b)
            })
            .collect();

        for cut in 1..cfg.num_layers {
            let load = |layers: std::ops::Range<usize>| {
                let o = BackendOptions {
                    device: Device::Cpu { threads: Some(2) },
                    format,
                    cpu: CpuOptions::threads(1),
                    check_finite: true,
                    kv_blocks: 12,
                    kv_block_size: 4,
                    kv_dtype: KvDtype::F32,
                    state_slots: 0,
                    state_snapshots: 0,
                };
                backend::load(&files, &cfg, layers, &o).unwrap()
            };
            let mut stages: Vec<Box<dyn Backend>> = vec![load(0..cut), load(cut..cfg.num_layers)];
            assert!(stages[0].shape().first && !stages[0].shape().last);
            assert_eq!(stages[1].info().threads, 2);
            // Scattered, interleaved block tables.
            let tables: [&[u32]; 3] = [&[7, 2, 10], &[0, 5, 3], &[11, 4, 9]];
            let run = |stages: &mut [Box<dyn Backend>], ids: &[u32], chunks: &[SeqChunk<'_>]| {
                let mut x = vec![0f32; ids.len() * h];
                stages[0].embed(ids, &mut x).unwrap();
                for s in stages.iter_mut() {
                    s.forward(&mut x, chunks).unwrap();
                }
                let mut last_rows = Vec::new();
                let mut end = 0;
                for c in chunks {
                    end += c.len;
                    last_rows.extend_from_slice(&x[(end - 1) * h..end * h]);
                }
                let mut logits = vec![0f32; chunks.len() * vocab];
                stages[1].logits(&last_rows, &mut logits).unwrap();
                logits
            };
            // Step 1: the first two prompts. Step 2: their next tokens plus the third prompt.
            let ids: Vec<u32> = prompts[..2].concat();
            let step1 = [0, 1].map(|i| SeqChunk {
                pos0: 0,
                len: prompts[i].len(),
                stored: 0,
                table: tables[i],
                state_slot: 0,
                prompt_len: 0,
            });
            let got = run(&mut stages, &ids, &step1);
            for i in 0..2 {
                assert_eq!(
                    got[i * vocab..(i + 1) * vocab],
                    solo[i].0[..],
                    "{name} cut {cut}: prefill {i}"
                );
            }
            let mut ids = vec![next[0], next[1]];
            ids.extend(&prompts[2]);
            let step2 = [
                SeqChunk {
                    pos0: prompts[0].len(),
                    len: 1,
                    stored: prompts[0].len(),
                    table: tables[0],
                    state_slot: 0,
                    prompt_len: 0,
                },
                SeqChunk {
                    pos0: prompts[1].len(),
                    len: 1,
                    stored: prompts[1].len(),
                    table: tables[1],
                    state_slot: 0,
                    prompt_len: 0,
                },
                SeqChunk {
                    pos0: 0,
                    len: prompts[2].len(),
                    stored: 0,
                    table: tables[2],
                    state_slot: 0,
                    prompt_len: 0,
                },
            ];
            let got = run(&mut stages, &ids, &step2);
            for (i, want) in [&solo[0].1, &solo[1].1, &solo[2].0].into_iter().enumerate() {
                assert_eq!(
                    got[i * vocab..(i + 1) * vocab],
                    want[..],
                    "{name} cut {cut}: step 2, sequence {i}"
                );
            }
            // A block id outside the pool is refused, naming it.
            let bad = [SeqChunk {
                pos0: 0,
                len: 1,
                stored: 0,
                table: &[12],
                state_slot: 0,
                prompt_len: 0,
            }];
            let mut x = vec![0f32; h];
            stages[0].embed(&[1], &mut x).unwrap();
            let e = stages[0].forward(&mut x, &bad).unwrap_err();
            assert!(e.to_string().contains("block id 12"), "{e}");
            // The first stage has no head, the last no embedding.
            assert!(stages[0].logits(&x, &mut vec![0f32; vocab]).is_err());
            assert!(stages[1].embed(&[1], &mut x).is_err());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_requests_match_their_solo_outputs_with_some_cancelled() {
    let model = default_model();
    let loaded = LoadedModel::open(&model).unwrap();
    let tok = &loaded.tokenizer;
    let words = "the quick brown fox jumps over the lazy dog while a small cat watches from the warm windowsill and the rain keeps falling on the old town";
    let all: Vec<&str> = words.split(' ').collect();
    // Mixed prompt lengths (1 to 27 words) and output lengths (3 to 18 tokens).
    let cases: Vec<(Vec<u32>, usize)> = (0..16)
        .map(|i| {
            let n = 1 + (i * 5) % all.len();
            let prompt = all[..n].join(" ");
            (tok.encode(&prompt, true).unwrap(), 3 + (i * 7) % 16)
        })
        .collect();
    let params = |max: usize| SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max)
    };
    let files = ModelFiles::open(&model).unwrap();
    let mut engine = Engine::new(StageWeights::load_full(&files, &loaded.config, true).unwrap());
    let solo: Vec<Vec<u32>> = cases
        .iter()
        .map(|(p, max)| engine.generate(p, &params(*max), None, |_| {}).unwrap().tokens)
        .collect();

    // Two workers computing at once on a small machine: allow slow heartbeats.
    let limits = Limits {
        max_running: 16,
        heartbeat: Duration::from_secs(2),
        ..Limits::default()
    };
    let tc = TestCluster::start_full(&model, &loaded.config, tok.eos_ids.clone(), &[15], &[], limits).await;
    let runs = cases.iter().enumerate().map(|(i, (prompt, max))| {
        let rx = tc.generator.submit(GenerationRequest {
            prompt: prompt.clone(),
            params: params(*max),
            top_logprobs: 0,
            logprobs: false,
        });
        // Every fifth request is cancelled after its second token.
        let cancel_after = (i % 5 == 2).then_some(2);
        async move {
            let mut rx = rx.unwrap();
            let mut got = Vec::new();
            while let Some(ev) = rx.recv().await {
                match ev {
                    TokenEvent::PromptCached { .. } => {}
                    TokenEvent::Token { id, .. } => got.push(id),
                    TokenEvent::Done { .. } => return (got, true),
                    TokenEvent::Failed { message, .. } => panic!("request {i} failed: {message}"),
                }
                if Some(got.len()) == cancel_after {
                    return (got, false);
                }
            }
            panic!("request {i}: stream ended without Done");
        }
    });
    let results = futures::future::join_all(runs).await;
    for (i, ((got, finished), want)) in results.iter().zip(&solo).enumerate() {
        if *finished {
            assert_eq!(got, want, "request {i} under load differs from alone");
        } else {
            assert_eq!(
                got[..],
                want[..got.len()],
                "cancelled request {i} diverged before it was cancelled"
            );
        }
    }
    assert_eq!(
        results.iter().filter(|r| !r.1).count(),
        3,
        "three requests were cancelled"
    );

    // Finished and cancelled sequences alike leave no KV behind on either stage.
    baton_tests::wait_until_async("no KV left behind on the coordinator or the workers", || async {
        let held = tc
            .generator
            .status
            .active_sequences
            .load(std::sync::atomic::Ordering::Relaxed);
        let on_workers: u32 = tc.stage_sequences().await.iter().sum();
        if held == 0 && on_workers == 0 {
            Ok(())
        } else {
            Err(format!(
                "KV still held: {held} on the coordinator, {on_workers} on workers"
            ))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_kv_pool_preempts_and_recomputes_without_changing_any_output() {
    // A dense model and a mixture of experts (whose rows are regrouped by expert in every
    // micro-batch).
    for name in ["llama_tied", "qwen3_moe"] {
        let dir = fixtures().join("tiny").join(name);
        let files = ModelFiles::open(&dir).unwrap();
        let cfg = files.config().unwrap();
        // Six requests of 12 + 36 = 48 positions (3 blocks of 16) each; the pool has 7 blocks, so
        // at most two run at once and the newest are preempted as the older ones grow.
        let cases: Vec<Vec<u32>> = (0..6).map(|i| tokens(i + 1, 12, cfg.vocab_size)).collect();
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(36)
        };
        let mut engine = Engine::new(StageWeights::load_full(&files, &cfg, true).unwrap());
        let solo: Vec<Vec<u32>> = cases
            .iter()
            .map(|p| engine.generate(p, &params, None, |_| {}).unwrap().tokens)
            .collect();

        let limits = Limits {
            kv_max_blocks: Some(7),
            heartbeat: Duration::from_secs(1),
            ..Limits::default()
        };
        let tc = TestCluster::start_full(&dir, &cfg, vec![], &[1], &[], limits).await;
        let runs = cases.iter().map(|p| tc.generate(p, params.clone()));
        let got = futures::future::join_all(runs).await;
        for (i, (g, want)) in got.into_iter().zip(&solo).enumerate() {
            assert_eq!(&g.unwrap().0, want, "{name}: request {i} changed by preemption");
        }
        let status = &tc.generator.status;
        let preempted = status.preemptions.load(std::sync::atomic::Ordering::Relaxed);
        assert!(
            preempted > 0,
            "the pool was too small for all six: someone must have been preempted"
        );
        assert_eq!(status.kv_blocks_total.load(std::sync::atomic::Ordering::Relaxed), 7);
        // Blocks return right after the last tokens are handed out.
        baton_tests::wait_until_async("every KV block is returned", || async {
            match status.kv_blocks_used.load(std::sync::atomic::Ordering::Relaxed) {
                0 => Ok(()),
                used => Err(format!("{used} blocks in use")),
            }
        })
        .await;

        // A prompt longer than the whole pool is refused with a clear error, and serving goes on.
        let e = tc
            .generate(&tokens(9, 120, cfg.vocab_size), params.clone())
            .await
            .unwrap_err();
        assert!(
            e.contains("needs 8 KV blocks") && e.contains("the pipeline has 7"),
            "{e}"
        );
        // One that fits but grows past the pool ends at the pool's size, like a length limit.
        let long = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(200)
        };
        let (out, reason) = tc.generate(&cases[0], long).await.unwrap();
        assert_eq!(reason, baton_coordinator::generation::FinishReason::Length);
        assert_eq!(
            out.len(),
            7 * 16 - 12 + 1,
            "generated until every position of the pool was used"
        );
        assert_eq!(out[..36], solo[0][..]);
    }
}
