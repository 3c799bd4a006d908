//! Hybrid models (Qwen3-Next and Qwen3.5: Gated DeltaNet layers with a recurrent state per sequence,
//! between gated full-attention layers) against transformers' own modeling code
//! (tests/fixtures/generate.py): logits at every position within 5e-4 (transformers runs the
//! chunked form of the delta rule for a prompt, Baton the recurrence token by token: the same
//! function summed in another order), greedy tokens equal; and whatever the split, chunking or
//! batching, bit-identical output, also through real worker processes.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use baton_coordinator::generation::FinishReason;
use baton_coordinator::speculative::{DraftMethod, Drafter, SpeculativeConfig};
use baton_shared::model_files::ModelFiles;
use baton_shared::proto::{HealthRequest, HealthResponse};
use baton_shared::sampling::SamplingParams;
use baton_tests::cluster::{Limits, TestCluster};
use baton_tests::{HYBRID_MODELS, every_split, f32s, fixtures, ids, max_abs_diff, read_json};
use baton_worker::backend::{self, BackendOptions, CpuOptions, Device, SeqChunk};
use baton_worker::engine::Engine;
use baton_worker::kernels::cpu::matmul::WeightFormat;
use baton_worker::kv_cache::{BatchSeq, KvDtype};
use baton_worker::model::spec::LayerKind;
use baton_worker::model::{Scratch, StageWeights};
use baton_worker::service::connect_worker;

/// Hybrids' tolerance against transformers.
const TOL: f32 = 5e-4;

fn files(name: &str) -> ModelFiles {
    ModelFiles::open(&fixtures().join("tiny").join(name)).unwrap()
}

fn engine(name: &str) -> Engine {
    let f = files(name);
    let cfg = f.config().unwrap();
    Engine::new(StageWeights::load_full(&f, &cfg, true).unwrap())
}

fn reference(name: &str) -> serde_json::Value {
    read_json(&fixtures().join("tiny").join(name).join("reference.json"))
}

#[test]
fn the_fixtures_mix_linear_and_full_attention_as_their_configs_say() {
    let e = engine("qwen3_next");
    let kinds: Vec<LayerKind> = e.weights.specs.iter().map(|s| s.kind).collect();
    use LayerKind::{Attention as F, LinearAttention as L};
    assert_eq!(kinds, [L, L, F, L, L], "the linear-attention layer last");
    assert_eq!((e.weights.cache.kv_layers, e.weights.cache.state_layers), (1, 4));
    let dense = engine("qwen3_next_dense");
    let kinds: Vec<LayerKind> = dense.weights.specs.iter().map(|s| s.kind).collect();
    assert_eq!(kinds, [F, L, L]);
    // Qwen3.5-MoE, text model and (as published) the multimodal checkpoint: every layer sparse,
    // each with its shared expert.
    for (name, want) in [("qwen3_5_moe", vec![L, F, L]), ("qwen3_5_moe_vl", vec![F, L, L, F, L])] {
        let e = engine(name);
        let kinds: Vec<LayerKind> = e.weights.specs.iter().map(|s| s.kind).collect();
        assert_eq!(kinds, want, "{name}");
        let moe = e.weights.config.moe.as_ref().expect("experts");
        assert_eq!((moe.num_experts, moe.experts_per_token), (12, 4), "{name}");
        assert!(
            moe.norm_topk_prob && (0..want.len()).all(|l| moe.is_sparse(l)),
            "{name}"
        );
        assert_eq!(moe.shared_expert_intermediate_size, Some(48), "{name}");
    }
}

#[test]
fn hybrid_models_match_transformers_logits_at_every_position() {
    for name in HYBRID_MODELS {
        let mut e = engine(name);
        let vocab = e.weights.config.vocab_size;
        let lengths: Vec<usize> = reference(name)["sequences"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["tokens"].as_array().unwrap().len())
            .collect();
        assert_eq!(lengths, [1, 7, 33, 80], "{name}");
        for (i, seq) in reference(name)["sequences"].as_array().unwrap().iter().enumerate() {
            let tokens = ids(&seq["tokens"]);
            let got = e.prompt_logits(&tokens, true).unwrap();
            let want: Vec<f32> = seq["logits"].as_array().unwrap().iter().flat_map(f32s).collect();
            assert_eq!(got.len(), tokens.len() * vocab);
            let err = max_abs_diff(&got, &want);
            eprintln!(
                "{name} sequence {i} ({} tokens): max |logit error| {err:e}",
                tokens.len()
            );
            assert!(err < TOL, "{name} sequence {i}: max |logit error| {err}");
        }
    }
}

#[test]
fn hybrid_models_match_transformers_greedy_tokens() {
    for name in HYBRID_MODELS {
        let mut e = engine(name);
        for case in reference(name)["greedy"].as_array().unwrap() {
            let prompt = ids(&case["prompt"]);
            let n = case["max_new_tokens"].as_u64().unwrap() as usize;
            let params = SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(n)
            };
            let out = e.generate(&prompt, &params, None, |_| {}).unwrap();
            assert_eq!(out.tokens, ids(&case["tokens"]), "{name} prompt {prompt:?}");
        }
    }
}

/// The hybrid fixtures that also come as GGUF files in llama.cpp's layout
/// (tests/fixtures/generate_hybrid_gguf.py): Qwen3-Next with split projections (`attn_qkv`,
/// `attn_gate`, `ssm_ba`) and a dense layer, Qwen3-Next in the older fused layout (`ssm_in`)
/// with its layer types as a flag array, and Qwen3.5 and Qwen3.5-MoE with value heads in
/// llama.cpp's key-head-minor order (the MoE one with a multi-token-prediction block after
/// its layers).
const GGUF_HYBRIDS: [&str; 4] = ["qwen3_next", "qwen3_next_dense", "qwen3_5", "qwen3_5_moe"];

#[test]
fn llama_cpp_gguf_files_of_the_hybrids_give_the_model_their_safetensors_give() {
    for name in GGUF_HYBRIDS {
        let path = fixtures().join("tiny").join(name).join("model.gguf");
        check_gguf_against_fixture(name, &path, TOL);
    }
}

/// Fixtures converted by llama.cpp's own `convert_hf_to_gguf.py` (the llama.cpp of xllamacpp
/// 2026.10.11549; tests/fixtures/convert_llamacpp.py): the MoE, Qwen3-Next as published (every
/// layer sparse), Qwen3.5 and Qwen3.5-MoE, with the tolerance of each against transformers.
const LLAMA_CPP_CONVERTED: [(&str, f32); 4] = [
    ("qwen3_moe", 1e-4),
    ("qwen3_next_sparse", TOL),
    ("qwen3_5", TOL),
    ("qwen3_5_moe", TOL),
];

#[test]
fn files_written_by_llama_cpps_own_converter_give_the_transformers_model() {
    for (name, tol) in LLAMA_CPP_CONVERTED {
        let path = fixtures().join("llamacpp").join(format!("{name}.gguf"));
        check_gguf_against_fixture(name, &path, tol);
    }
}

/// The GGUF at `path` holds tiny fixture `name`'s weights: the config read from its metadata
/// is the safetensors one; its logits are transformers' within `tol` at every position and the
/// safetensors' within 1e-4; its greedy tokens are transformers'; and every two-stage split of
/// it gives its one-stage bits.
fn check_gguf_against_fixture(name: &str, path: &std::path::Path, tol: f32) {
    let (gguf, hf) = (ModelFiles::open(path).unwrap(), files(name));
    let gc = gguf.config().unwrap();
    // The GGUF layout is what only the GGUF config has; the rest must be the safetensors'.
    let mut without_layout = gc.clone();
    if let Some(linear) = without_layout.linear_attention.as_mut() {
        assert!(linear.gguf_layout.take().is_some(), "{name}: a GGUF layout");
    }
    assert_eq!(
        without_layout,
        hf.config().unwrap(),
        "{name}: the config read from GGUF metadata"
    );
    let mut from_gguf = Engine::new(StageWeights::load_full(&gguf, &gc, true).unwrap());
    let mut from_hf = engine(name);
    for (i, seq) in reference(name)["sequences"].as_array().unwrap().iter().enumerate() {
        let tokens = ids(&seq["tokens"]);
        let got = from_gguf.prompt_logits(&tokens, true).unwrap();
        let want: Vec<f32> = seq["logits"].as_array().unwrap().iter().flat_map(f32s).collect();
        let (err, vs_hf) = (
            max_abs_diff(&got, &want),
            max_abs_diff(&got, &from_hf.prompt_logits(&tokens, true).unwrap()),
        );
        eprintln!(
            "{name} ({}) sequence {i}: max |logit error| {err:e}, {vs_hf:e} from the safetensors",
            path.display()
        );
        assert!(err < tol, "{name} sequence {i}: max |logit error| {err}");
        // The same weights: only A = -exp(A_log) (computed by the converter, not here) and the
        // products' blocking over split matrices may differ in the last bits.
        assert!(vs_hf < 1e-4, "{name} sequence {i}: {vs_hf} from the safetensors");
    }
    for case in reference(name)["greedy"].as_array().unwrap() {
        let prompt = ids(&case["prompt"]);
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(case["max_new_tokens"].as_u64().unwrap() as usize)
        };
        let out = from_gguf.generate(&prompt, &params, None, |_| {}).unwrap();
        assert_eq!(out.tokens, ids(&case["tokens"]), "{name} GGUF prompt {prompt:?}");
    }
    // Every two-stage split of the GGUF model gives its one-stage bits.
    let tokens = long_prompt(name);
    let whole = from_gguf.prompt_logits(&tokens, true).unwrap();
    for cut in 1..gc.num_layers {
        let stages = [
            StageWeights::load(&gguf, &gc, 0..cut, true, false, true).unwrap(),
            StageWeights::load(&gguf, &gc, cut..gc.num_layers, false, true, true).unwrap(),
        ];
        let mut hidden = embedded(&stages[0], &tokens);
        let mut scratch = Scratch::default();
        for s in &stages {
            s.forward(&mut hidden, 0, &mut s.new_kv(tokens.len()), &mut scratch)
                .unwrap();
        }
        let mut got = vec![0f32; tokens.len() * gc.vocab_size];
        stages[1].logits(&hidden, &mut scratch, &mut got).unwrap();
        assert_eq!(got, whole, "{name} GGUF split at {cut}");
    }
}

#[test]
fn fused_expert_files_give_the_per_expert_model_bit_for_bit() {
    // tiny/qwen3_5_moe_fused holds qwen3_5_moe's weights with the experts as published
    // Qwen3.5-MoE checkpoints keep them (`mlp.experts.gate_up_proj` [12, 64, 64] and
    // `mlp.experts.down_proj`, written from transformers' own module state), and as a GGUF with
    // `ffn_gate_up_exps`; its logits must be the per-expert files' logits, bit for bit.
    let dir = fixtures().join("tiny").join("qwen3_5_moe_fused");
    let (hf, gguf) = (
        ModelFiles::open(&dir).unwrap(),
        ModelFiles::open(&dir.join("model.gguf")).unwrap(),
    );
    let names = hf.tensor_names();
    assert!(names.contains("model.layers.0.mlp.experts.gate_up_proj"), "{names:?}");
    assert!(
        !names.iter().any(|n| n.contains("experts.0.")),
        "no per-expert tensor left"
    );
    let names = gguf.tensor_names();
    assert!(names.contains("blk.0.ffn_gate_up_exps.weight"), "{names:?}");
    assert!(!names.contains("blk.0.ffn_gate_exps.weight"));
    let per_expert_gguf = ModelFiles::open(&fixtures().join("tiny/qwen3_5_moe/model.gguf")).unwrap();
    let load = |f: &ModelFiles| Engine::new(StageWeights::load_full(f, &f.config().unwrap(), true).unwrap());
    let pairs = [
        ("safetensors", load(&hf), engine("qwen3_5_moe")),
        ("GGUF", load(&gguf), load(&per_expert_gguf)),
    ];
    for (format, mut fused, mut per_expert) in pairs {
        for seq in reference("qwen3_5_moe")["sequences"].as_array().unwrap() {
            let tokens = ids(&seq["tokens"]);
            let got = fused.prompt_logits(&tokens, true).unwrap();
            assert_eq!(
                got,
                per_expert.prompt_logits(&tokens, true).unwrap(),
                "{format}, {} tokens",
                tokens.len()
            );
            let want: Vec<f32> = seq["logits"].as_array().unwrap().iter().flat_map(f32s).collect();
            assert!(max_abs_diff(&got, &want) < TOL, "{format}");
        }
    }
}

/// The longest reference prompt (80 tokens).
fn long_prompt(name: &str) -> Vec<u32> {
    ids(&reference(name)["sequences"][3]["tokens"])
}

/// The embedding rows of `ids`.
fn embedded(w: &StageWeights, ids: &[u32]) -> Vec<f32> {
    let mut x = vec![0f32; ids.len() * w.config.hidden_size];
    w.embed(ids, &mut x).unwrap();
    x
}

/// Hidden rows after every layer of `w` for `tokens` fed in chunks of `chunk`, the state
/// carried from chunk to chunk.
fn chunked_hidden(w: &StageWeights, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let mut kv = w.new_kv(tokens.len());
    let mut scratch = Scratch::default();
    let mut out = Vec::new();
    for (c, piece) in tokens.chunks(chunk).enumerate() {
        let mut x = embedded(w, piece);
        w.forward(&mut x, c * chunk, &mut kv, &mut scratch).unwrap();
        out.extend(x);
    }
    out
}

#[test]
fn a_prompt_gives_the_same_bits_however_it_is_cut_on_delta_rule_windows() {
    // The coordinator ends a hybrid prompt's chunks on window boundaries (below its last whole
    // window), and then the bits do not depend on the cut. Cut elsewhere, whole windows run
    // token by token instead: the same function in another order, off in the last bits only.
    let window = baton_shared::model_config::DELTA_RULE_WINDOW;
    for name in HYBRID_MODELS {
        let f = files(name);
        let w = StageWeights::load_full(&f, &f.config().unwrap(), true).unwrap();
        let tokens = long_prompt(name);
        let whole = chunked_hidden(&w, &tokens, tokens.len());
        for chunk in [window, 2 * window, 3 * window] {
            assert_eq!(chunked_hidden(&w, &tokens, chunk), whole, "{name}, chunks of {chunk}");
        }
        for chunk in [1, 5, 33] {
            let got = chunked_hidden(&w, &tokens, chunk);
            assert_ne!(
                got, whole,
                "{name}, chunks of {chunk}: whole windows ran token by token"
            );
            let off = got
                .iter()
                .zip(&whole)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
                .fold(0f32, f32::max);
            // Within the hybrids' tolerance against transformers (5e-4): both forms are held to it.
            assert!(off < 5e-4, "{name}, chunks of {chunk}: off by {off}");
        }
    }
}

#[test]
fn every_split_into_two_and_three_stages_gives_the_same_bits_as_one() {
    for name in HYBRID_MODELS {
        let f = files(name);
        let cfg = f.config().unwrap();
        let tokens = long_prompt(name);
        let whole = engine(name).prompt_logits(&tokens, true).unwrap();
        let n = cfg.num_layers;
        let mut splits: Vec<Vec<usize>> = (1..n).map(|c| vec![c]).collect();
        splits.extend((1..n).flat_map(|a| (a + 1..n).map(move |b| vec![a, b])));
        for cuts in splits {
            let mut bounds = vec![0];
            bounds.extend(&cuts);
            bounds.push(n);
            let stages: Vec<StageWeights> = bounds
                .windows(2)
                .enumerate()
                .map(|(i, b)| StageWeights::load(&f, &cfg, b[0]..b[1], i == 0, i == bounds.len() - 2, true).unwrap())
                .collect();
            let mut hidden = vec![0f32; tokens.len() * cfg.hidden_size];
            let mut scratch = Scratch::default();
            stages[0].embed(&tokens, &mut hidden).unwrap();
            for s in &stages {
                s.forward(&mut hidden, 0, &mut s.new_kv(tokens.len()), &mut scratch)
                    .unwrap();
            }
            let mut got = vec![0f32; tokens.len() * cfg.vocab_size];
            stages.last().unwrap().logits(&hidden, &mut scratch, &mut got).unwrap();
            assert_eq!(got, whole, "{name} split at {cuts:?}");
        }
    }
}

#[test]
fn batched_sequences_with_prompts_and_decodes_equal_each_alone() {
    for name in HYBRID_MODELS {
        let f = files(name);
        let cfg = f.config().unwrap();
        let w = StageWeights::load_full(&f, &cfg, true).unwrap();
        let prompt = long_prompt(name);
        let embed = |ids: &[u32]| embedded(&w, ids);
        // Alone: A's first 20 tokens then its 21st; B's 9 tokens; C's 1.
        let (a, b, c) = (&prompt[..21], &prompt[30..39], &prompt[50..51]);
        let mut scratch = Scratch::default();
        let mut kv_a = w.new_kv(32);
        let mut x = embed(&a[..20]);
        w.forward(&mut x, 0, &mut kv_a, &mut scratch).unwrap();
        let mut want_step2 = embed(&a[20..]);
        w.forward(&mut want_step2, 20, &mut kv_a, &mut scratch).unwrap();
        let want_b = chunked_hidden(&w, b, b.len());
        let want_c = chunked_hidden(&w, c, 1);

        // Together: A's prefill alone, then A's decode with B's and C's prompts in one batch.
        let mut kv_a = w.new_kv(32);
        let mut x = embed(&a[..20]);
        w.forward(&mut x, 0, &mut kv_a, &mut scratch).unwrap();
        let (mut kv_b, mut kv_c) = (w.new_kv(16), w.new_kv(16));
        let mut x: Vec<f32> = [embed(&a[20..]), embed(b), embed(c)].concat();
        let mut batch = [
            BatchSeq {
                pos0: 20,
                len: 1,
                prompt_len: 0,
                kv: &mut kv_a,
            },
            BatchSeq {
                pos0: 0,
                len: b.len(),
                prompt_len: b.len(),
                kv: &mut kv_b,
            },
            BatchSeq {
                pos0: 0,
                len: 1,
                prompt_len: 1,
                kv: &mut kv_c,
            },
        ];
        w.forward_batch(&mut x, &mut batch[..], &mut scratch).unwrap();
        assert_eq!(x, [want_step2, want_b, want_c].concat(), "{name}");
    }
}

/// A stage's paged backend: `blocks` KV blocks of 16 positions, `slots` state slots.
fn paged_backend(name: &str, blocks: usize, slots: usize) -> Box<dyn backend::Backend> {
    let f = files(name);
    let cfg = f.config().unwrap();
    let opts = BackendOptions {
        device: Device::Cpu { threads: Some(1) },
        format: WeightFormat::F32,
        cpu: CpuOptions::threads(1),
        check_finite: true,
        kv_blocks: blocks,
        kv_block_size: 16,
        kv_dtype: KvDtype::F32,
        state_slots: slots,
        state_snapshots: 0,
    };
    backend::load(&f, &cfg, 0..cfg.num_layers, &opts).unwrap()
}

#[test]
fn the_paged_backend_keeps_each_sequences_state_in_its_own_slot() {
    for name in HYBRID_MODELS {
        let f = files(name);
        let cfg = f.config().unwrap();
        let w = StageWeights::load_full(&f, &cfg, true).unwrap();
        let h = cfg.hidden_size;
        let prompt = long_prompt(name);
        let (a, b) = (&prompt[..40], &prompt[40..]);
        let want_a = chunked_hidden(&w, a, a.len());
        let want_b = chunked_hidden(&w, b, b.len());
        let mut be = paged_backend(name, 8, 2);
        assert_eq!(be.kv().state_slots, 2);
        let embed = |ids: &[u32]| embedded(&w, ids);
        // Two sequences in slots 1 and 0, their prompts cut into interleaved chunks of 16 (one
        // delta-rule window each, as the coordinator cuts a hybrid's prompts).
        let (ta, tb) = ([0u32, 1, 2], [3u32, 4, 5]);
        let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
        for c in 0..3 {
            let (ra, rb) = (c * 16..(c * 16 + 16).min(40), c * 16..(c * 16 + 16).min(b.len()));
            let mut x = [embed(&a[ra.clone()]), embed(&b[rb.clone()])].concat();
            let seqs = [
                SeqChunk {
                    pos0: ra.start,
                    len: ra.len(),
                    stored: ra.start,
                    table: &ta,
                    state_slot: 1,
                    prompt_len: a.len(),
                },
                SeqChunk {
                    pos0: rb.start,
                    len: rb.len(),
                    stored: rb.start,
                    table: &tb,
                    state_slot: 0,
                    prompt_len: b.len(),
                },
            ];
            be.forward(&mut x, &seqs).unwrap();
            got_a.extend_from_slice(&x[..ra.len() * h]);
            got_b.extend_from_slice(&x[ra.len() * h..]);
        }
        assert_eq!(got_a, want_a, "{name}: sequence in slot 1");
        assert_eq!(got_b, want_b, "{name}: sequence in slot 0");
        // A slot outside the pool is refused by name.
        let mut x = embed(&a[..1]);
        let bad = [SeqChunk {
            pos0: 0,
            len: 1,
            stored: 0,
            table: &ta,
            state_slot: 2,
            prompt_len: 0,
        }];
        let e = be.forward(&mut x, &bad).unwrap_err().to_string();
        assert!(e.contains("state slot 2") && e.contains("2 slots"), "{e}");
    }
}

/// Limits of a hybrid pipeline: prefix caching on (a cached prefix restarts from a
/// recurrent-state snapshot; a preempted sequence from its own), small prefill chunks so
/// prompts cross the stages in several pieces.
fn hybrid_limits() -> Limits {
    Limits {
        prefix_caching: true,
        max_batch_tokens: 24,
        ..Limits::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sized_running_limit_gives_every_stage_that_many_state_slots() {
    // Limits left to the sizing on two workers with 1 MiB of KV budget each: the running
    // limit comes from the profiles, the KV pool and the state slots that fit (not a fixed 64),
    // every stage with linear-attention layers allocates that many slots, and output is each
    // prompt's own.
    use baton_coordinator::generation::Generator;
    use baton_coordinator::pipeline::sizing::AutoLimits;
    let name = "qwen3_next";
    let dir = fixtures().join("tiny").join(name);
    let cfg = files(name).config().unwrap();
    let params = greedy_params(6);
    let Workload { prompts, want, .. } = sixteen_streams(name, &params);
    let limits = Limits {
        auto_limits: AutoLimits {
            max_running: true,
            max_batch_tokens: true,
        },
        max_running: 64,
        ..hybrid_limits()
    };
    let flags = vec![vec!["--kv-cache-mib".to_string(), "1".to_string()]; 2];
    let tc = TestCluster::start_full(&dir, &cfg, vec![], &[2], &flags, limits).await;
    let got = futures::future::join_all(prompts.iter().map(|p| tc.generate(p, params.clone()))).await;
    for ((p, w), g) in prompts.iter().zip(&want).zip(got) {
        assert_eq!(&g.unwrap().0, w, "prompt of {} tokens", p.len());
    }
    let view = tc.generator.describe();
    let running = view["limits"]["max_running"].as_u64().unwrap();
    let bound = view["limits"]["max_running_bound"].as_str().unwrap();
    // Sequences end and start all the time with every slot in use: each stage drops the ended
    // ones before the batch that starts new ones (MicroBatch.free), so no batch fails for want
    // of a slot and the pipeline never breaks.
    assert_eq!(view["migrations_total"], 0, "{view}");
    assert!(
        running < 64 && ["state_memory", "kv_pool", "step_cost"].contains(&bound),
        "{view}"
    );
    for w in tc.cluster.alive() {
        let mut client = connect_worker(&w.address, &tc.peer).await.unwrap();
        let h = client.health(HealthRequest {}).await.unwrap().into_inner();
        // Both stages hold linear-attention layers (L L | F L L).
        assert!(u64::from(h.state_slots_total) >= running, "{h:?} for {running} running");
    }
}

/// Worker flags that serve each worker's metrics on a port it picks.
fn metrics_flags(workers: usize) -> Vec<Vec<String>> {
    vec![vec!["--metrics-listen".to_string(), "127.0.0.1:0".to_string()]; workers]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefixes_restart_from_state_snapshots_on_every_stage() {
    // A prompt, a second sharing its first 50 tokens, and the first's next turn (the prompt,
    // its reply and more), one after another in this process and through 1 and 3 worker
    // processes: the later two
    // start from a recurrent-state snapshot of their cached prefix on every stage with
    // linear-attention layers, and each equals one engine alone.
    let params = greedy_params(8);
    for name in HYBRID_MODELS {
        let dir = fixtures().join("tiny").join(name);
        let cfg = files(name).config().unwrap();
        let long = long_prompt(name);
        let mut e = engine(name);
        let first = long[..70].to_vec();
        let reply = e.generate(&first, &params, None, |_| {}).unwrap().tokens;
        let prompts = vec![
            first.clone(),
            [&long[..50], &long[5..25]].concat(),
            [&first[..], &reply[..], &long[70..80]].concat(),
        ];
        let Workload { prompts, want, .. } = Workload::generated(&mut e, prompts, &params);
        let (got, hits) = in_process(&dir, &prompts, &params).await;
        assert_eq!(got, want, "{name} in this process");
        assert_eq!(hits, 48 + 64, "{name} in this process");
        for cuts in [vec![], vec![1, cfg.num_layers - 1]] {
            let stages = cuts.len() + 1;
            let tc = TestCluster::start_full(&dir, &cfg, vec![], &cuts, &metrics_flags(stages), hybrid_limits()).await;
            for (p, w) in prompts.iter().zip(&want) {
                let (got, _) = tc.generate(p, params.clone()).await.unwrap();
                assert_eq!(&got, w, "{name} with cuts {cuts:?}, prompt of {} tokens", p.len());
            }
            // Chunks end on block boundaries (16 positions), each snapshotting the state: the
            // second prompt starts from the snapshot at 48 (its 4th block differs), the next
            // turn from 64 (the first prompt's last full block; its reply filled no block).
            let hits = tc.generator.status.prefix_hit_tokens.load(Ordering::Relaxed);
            assert_eq!(hits, 48 + 64, "{name} with cuts {cuts:?}");
            let counts = worker_counts(&tc, "baton_worker_state_snapshots_restored_total").await;
            assert!(
                counts.iter().any(|(_, h, _)| h.state_snapshots_total > 0),
                "{name}: {cuts:?}"
            );
            for (start, h, restored) in counts {
                let want = if h.state_snapshots_total > 0 { 2 } else { 0 };
                assert_eq!(
                    restored, want,
                    "{name} with cuts {cuts:?}: the stage from layer {start}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_through_every_split_of_worker_processes_equals_one_stage() {
    for name in HYBRID_MODELS {
        let dir = fixtures().join("tiny").join(name);
        let cfg = files(name).config().unwrap();
        let prompt = long_prompt(name)[..40].to_vec();
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(10)
        };
        let want = engine(name).generate(&prompt, &params, None, |_| {}).unwrap().tokens;
        for cuts in every_split(cfg.num_layers) {
            let tc = TestCluster::start_full(&dir, &cfg, vec![], &cuts, &[], hybrid_limits()).await;
            let (got, reason) = tc.generate(&prompt, params.clone()).await.unwrap();
            assert_eq!(got, want, "{name} with cuts {cuts:?}");
            assert_eq!(reason, FinishReason::Length);
        }
    }
}

/// Greedy decoding of `max_tokens` with EOS ignored.
fn greedy_params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

/// Sixteen prompts of 2 to 47 tokens and what one engine generates for each alone.
fn sixteen_streams(name: &str, params: &SamplingParams) -> Workload {
    let prompts: Vec<Vec<u32>> = (0..16u32)
        .map(|s| (0..2 + 3 * s).map(|i| (s * 41 + i * 13 + 7) % 300).collect())
        .collect();
    let mut e = engine(name);
    Workload::generated(&mut e, prompts, params)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sequences_with_preemption_equal_each_alone_through_three_stages() {
    // Sixteen prompts of different lengths at once through 3 worker processes, in a KV pool
    // of 12 blocks: prefill chunks and decodes share micro-batches, and sequences are
    // preempted and recomputed from position 0 (their state slot reset), yet each gets exactly
    // its own single-stage tokens.
    let name = "qwen3_next";
    let dir = fixtures().join("tiny").join(name);
    let cfg = files(name).config().unwrap();
    let params = greedy_params(12);
    let Workload { prompts, want, .. } = sixteen_streams(name, &params);
    let limits = Limits {
        kv_max_blocks: Some(12),
        max_running: 16,
        ..hybrid_limits()
    };
    let tc = TestCluster::start_full(&dir, &cfg, vec![], &[2, 3], &[], limits).await;
    let got = futures::future::join_all(prompts.iter().map(|p| tc.generate(p, params.clone()))).await;
    for ((p, w), g) in prompts.iter().zip(&want).zip(got) {
        assert_eq!(&g.unwrap().0, w, "prompt of {} tokens", p.len());
    }
    let preempted = tc
        .generator
        .status
        .preemptions
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(preempted > 0, "the tiny pool preempted sequences");
    // Layers L L | F | L L: the stages with linear-attention layers keep a state slot per
    // sequence that may run (16), the attention-only one none; finished sequences hold none.
    // A finished sequence's release reaches the stages after its last token reaches the
    // client, so read until the releases have landed (or 10 s have passed).
    let want = [(0, 0, 16), (2, 0, 0), (3, 0, 16)];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let slots = loop {
        let mut slots = Vec::new();
        for w in tc.cluster.alive() {
            let mut client = connect_worker(&w.address, &tc.peer).await.unwrap();
            let h = client.health(HealthRequest {}).await.unwrap().into_inner();
            let stage = h.stage.unwrap();
            slots.push((stage.layer_start, h.state_slots_used, h.state_slots_total));
        }
        slots.sort();
        if slots == want || std::time::Instant::now() > deadline {
            break slots;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(slots, want);
}

/// Proposes the model's own continuation with one proposal made wrong, at a place that moves
/// with every call (none when it falls past the proposal), so every acceptance length from 0
/// to k occurs and each stage rolls its recurrent state back by every amount.
struct Stumbling {
    full: Arc<Vec<Vec<u32>>>,
    /// Proposals made so far; `None`: never stumble.
    calls: Option<usize>,
}

impl Drafter for Stumbling {
    fn method(&self) -> DraftMethod {
        DraftMethod::Ngram
    }

    fn propose(&mut self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        let Some(full) = self
            .full
            .iter()
            .find(|f| f.len() > tokens.len() && f.starts_with(tokens))
        else {
            return;
        };
        let start = out.len();
        out.extend(full[tokens.len()..].iter().take(k));
        if let Some(calls) = self.calls.as_mut() {
            let wrong = start + *calls % (k + 1);
            *calls += 1;
            if let Some(t) = out.get_mut(wrong) {
                *t = if *t == 0 { 1 } else { *t - 1 };
            }
        }
    }
}

/// A drafter per sequence: [`Stumbling`] over `full` (each prompt followed by its greedy
/// continuation), or with `stumble` false the continuation itself (every proposal accepted).
fn drafting(k: usize, full: &[Vec<u32>], stumble: bool) -> SpeculativeConfig {
    let full = Arc::new(full.to_vec());
    SpeculativeConfig {
        custom: Some(Arc::new(move || {
            Box::new(Stumbling {
                full: full.clone(),
                calls: stumble.then_some(0),
            }) as Box<dyn Drafter>
        })),
        ..SpeculativeConfig::new(DraftMethod::Ngram, k)
    }
}

/// Prompts, their greedy continuations, and each prompt followed by its continuation.
struct Workload {
    prompts: Vec<Vec<u32>>,
    want: Vec<Vec<u32>>,
    full: Vec<Vec<u32>>,
}

impl Workload {
    /// `prompts` with what `e` generates for each alone.
    fn generated(e: &mut Engine, prompts: Vec<Vec<u32>>, params: &SamplingParams) -> Self {
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| e.generate(p, params, None, |_| {}).unwrap().tokens)
            .collect();
        let full = prompts
            .iter()
            .zip(&want)
            .map(|(p, w)| [p.clone(), w.clone()].concat())
            .collect();
        Self { prompts, want, full }
    }
}

/// Three prompts for `name`: one that quotes itself (a text, what the model wrote after it,
/// the text again), so prompt lookup proposes what followed the text, and two that do not.
fn workload(name: &str, params: &SamplingParams) -> Workload {
    let long = long_prompt(name);
    let mut e = engine(name);
    let text = long[..6].to_vec();
    let after = e.generate(&text, params, None, |_| {}).unwrap().tokens;
    let quoting = [&text[..], &after[..8], &text[..]].concat();
    let prompts = vec![quoting, long[..17].to_vec(), long[5..8].to_vec()];
    Workload::generated(&mut e, prompts, params)
}

/// `prompts` one after another through the in-process stage of `baton serve --workers 0`
/// (prefix caching on, 24-token steps): each one's tokens, and the prompt tokens reused from
/// the prefix cache.
async fn in_process(dir: &std::path::Path, prompts: &[Vec<u32>], params: &SamplingParams) -> (Vec<Vec<u32>>, u64) {
    use baton_coordinator::local::{self, LocalStageOptions};
    use baton_coordinator::pipeline::PipelineConfig;
    use baton_tests::cluster::generate_on;
    let cfg = ModelFiles::open(dir).unwrap().config().unwrap();
    let config = PipelineConfig {
        max_batch_tokens: 24,
        ..PipelineConfig::new(dir.display().to_string(), &cfg, vec![])
    };
    let opts = LocalStageOptions {
        state_snapshots: config.state_snapshots,
        ..LocalStageOptions::default()
    };
    let generator = local::start(config, dir, &opts).unwrap();
    generator.wait_ready(baton_tests::PATIENCE).await.unwrap();
    let mut out = Vec::new();
    for p in prompts {
        out.push(generate_on(&generator, p, params.clone()).await.unwrap().0);
    }
    (out, generator.status.prefix_hit_tokens.load(Ordering::Relaxed))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_process_hybrid_runs_as_many_sequences_as_its_state_slots_fit_the_kv_budget() {
    // A Qwen3-Next state slot is tens of MB: `baton serve --workers 0` on such a model with the
    // default 64 slots and 32 snapshots failed to start in 1 GiB. Here the budget holds the
    // snapshots and three sequences (each a state slot and its planned K/V) and no more.
    use baton_coordinator::local::{self, LocalStageOptions};
    use baton_coordinator::pipeline::{PipelineConfig, sizing};
    use baton_tests::cluster::generate_on;
    let dir = fixtures().join("tiny").join("qwen3_next");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let config = PipelineConfig {
        max_running: sizing::HYBRID_MAX_RUNNING,
        auto_limits: sizing::AutoLimits {
            max_running: true,
            max_batch_tokens: false,
        },
        ..PipelineConfig::new(dir.display().to_string(), &cfg, vec![])
    };
    let bytes = config.cache_bytes(0..cfg.num_layers);
    let planned_blocks = sizing::PLANNED_POSITIONS
        .min(config.max_context)
        .div_ceil(config.kv_block_size);
    let per_sequence = bytes.per_state as u64 + (planned_blocks * bytes.per_block) as u64;
    let budget = config.state_snapshots as u64 * bytes.per_state as u64 + 3 * per_sequence + per_sequence / 2;
    let opts = LocalStageOptions {
        kv_budget_bytes: budget,
        state_slots: config.max_running,
        state_snapshots: config.state_snapshots,
        ..LocalStageOptions::default()
    };
    let generator = local::start(config, &dir, &opts).expect("starts within the budget");
    generator.wait_ready(baton_tests::PATIENCE).await.unwrap();
    let limits = generator
        .status
        .limits
        .lock()
        .unwrap()
        .clone()
        .expect("published limits");
    // The K/V left beside three slots holds three sequences' planned positions too, so either
    // bound may be the one named.
    assert_eq!(limits.max_running, 3, "{limits:?}");
    let prompt = long_prompt("qwen3_next");
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(4)
    };
    let (tokens, _) = generate_on(&generator, &prompt, params.clone()).await.unwrap();
    let alone = engine("qwen3_next").generate(&prompt, &params, None, |_| {}).unwrap();
    assert_eq!(tokens, alone.tokens);
}

/// Per worker, by first layer: its health and the sum of the samples of its metric `name`.
async fn worker_counts(tc: &TestCluster, name: &str) -> Vec<(u32, HealthResponse, u64)> {
    let mut out = Vec::new();
    for w in tc.cluster.alive() {
        let mut client = connect_worker(&w.address, &tc.peer).await.unwrap();
        let h = client.health(HealthRequest {}).await.unwrap().into_inner();
        let text = baton_tests::serve::http_request(&w.metrics_address, "GET", "/metrics", "").1;
        let count: u64 = text
            .lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64;
        out.push((h.stage.as_ref().unwrap().layer_start, h, count));
    }
    out.sort_by_key(|(start, ..)| *start);
    out
}

/// Per worker: (first layer, recurrent-state slots, state replays its metrics count).
async fn replays(tc: &TestCluster) -> Vec<(u32, u32, u64)> {
    let counts = worker_counts(tc, "baton_spec_state_replays_total").await;
    counts
        .into_iter()
        .map(|(start, h, n)| (start, h.state_slots_total, n))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_decoding_rolls_the_recurrent_state_back_on_every_stage() {
    // Verify steps whose proposals are partly rejected, through 1, 2 and 3 worker processes:
    // each stage with linear-attention layers puts the state back and replays the accepted
    // rows, so the output is plain greedy decoding's, token for token.
    let params = greedy_params(16);
    for name in HYBRID_MODELS {
        let dir = fixtures().join("tiny").join(name);
        let cfg = files(name).config().unwrap();
        let Workload { prompts, want, full } = workload(name, &params);
        let n = cfg.num_layers;
        for cuts in [vec![], vec![n / 2], vec![1, n - 1]] {
            let tc =
                TestCluster::start_speculative(&dir, &cfg, vec![], &cuts, hybrid_limits(), drafting(4, &full, true))
                    .await;
            let got = futures::future::join_all(prompts.iter().map(|p| tc.generate(p, params.clone()))).await;
            for (i, (g, w)) in got.into_iter().zip(&want).enumerate() {
                assert_eq!(&g.unwrap().0, w, "{name}, cuts {cuts:?}, prompt {i}");
            }
            let s = &tc.generator.status;
            let (proposed, accepted) = (
                s.spec_proposed_tokens.load(Ordering::Relaxed),
                s.spec_accepted_tokens.load(Ordering::Relaxed),
            );
            assert!(
                0 < accepted && accepted < proposed,
                "{name}: {accepted} of {proposed} accepted"
            );
            // Every stage that keeps recurrent state rolled it back; the others had none to.
            for (layer, slots, replayed) in replays(&tc).await {
                assert_eq!(replayed > 0, slots > 0, "{name}, cuts {cuts:?}: stage at layer {layer}");
            }
        }
    }
    // Prompt lookup, and the model's own continuation (k + 1 tokens every verify step, no
    // rollback), through two stages.
    let name = "qwen3_next";
    let dir = fixtures().join("tiny").join(name);
    let cfg = files(name).config().unwrap();
    let Workload { prompts, want, full } = workload(name, &params);
    for (drafter, spec) in [
        ("n-gram", SpeculativeConfig::new(DraftMethod::Ngram, 4)),
        ("oracle", drafting(4, &full, false)),
    ] {
        let tc = TestCluster::start_speculative(&dir, &cfg, vec![], &[2], hybrid_limits(), spec).await;
        for (i, (p, w)) in prompts.iter().zip(&want).enumerate() {
            assert_eq!(
                &tc.generate(p, params.clone()).await.unwrap().0,
                w,
                "{drafter}, prompt {i}"
            );
        }
        let s = &tc.generator.status;
        let (steps, proposed, accepted) = (
            s.spec_steps.load(Ordering::Relaxed),
            s.spec_proposed_tokens.load(Ordering::Relaxed),
            s.spec_accepted_tokens.load(Ordering::Relaxed),
        );
        assert!(proposed > 0, "{drafter}: proposals were made");
        if drafter == "oracle" {
            // 16 tokens per prompt: the first from the prompt, then three verify steps of 4 + 1.
            assert_eq!((steps, proposed, accepted), (9, 36, 36));
            assert!(replays(&tc).await.iter().all(|r| r.2 == 0), "nothing to roll back");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_speculative_streams_with_preemption_equal_plain_through_three_stages() {
    // The concurrent test above with partly rejected proposals: verify chunks, prefill chunks
    // and decodes share micro-batches, and preempted sequences restart from position 0 (their
    // kept state dropped with them). Finishing sooner, the streams need a smaller pool than
    // without proposals (6 blocks, not 12) to be preempted.
    let name = "qwen3_next";
    let dir = fixtures().join("tiny").join(name);
    let cfg = files(name).config().unwrap();
    let params = greedy_params(24);
    let Workload { prompts, want, full } = sixteen_streams(name, &params);
    let limits = Limits {
        kv_max_blocks: Some(6),
        max_running: 16,
        ..hybrid_limits()
    };
    let tc = TestCluster::start_speculative(&dir, &cfg, vec![], &[2, 3], limits, drafting(3, &full, true)).await;
    let got = futures::future::join_all(prompts.iter().map(|p| tc.generate(p, params.clone()))).await;
    for ((p, w), g) in prompts.iter().zip(&want).zip(got) {
        assert_eq!(&g.unwrap().0, w, "prompt of {} tokens", p.len());
    }
    let s = &tc.generator.status;
    assert!(
        s.preemptions.load(Ordering::Relaxed) > 0,
        "the tiny pool preempted sequences"
    );
    let accepted = s.spec_accepted_tokens.load(Ordering::Relaxed);
    assert!(0 < accepted && accepted < s.spec_proposed_tokens.load(Ordering::Relaxed));
    for (layer, slots, replayed) in replays(&tc).await {
        assert_eq!(replayed > 0, slots > 0, "stage at layer {layer}");
    }
}
