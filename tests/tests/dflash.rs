//! DFlash pieces against the committed fixtures (tests/fixtures/generate_dflash.py): the taps
//! are transformers' `hidden_states[id + 1]`, the context sum built stage by stage equals
//! `concat(taps) · fcᵀ` for every split, and the draft's forward pass equals the script's
//! reference implementation on random draft weights.

use std::ops::Range;

use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::ModelFiles;
use baton_tests::{f32s, fixtures, ids, max_abs_diff, read_json};
use baton_worker::kv_cache::{AnyKv, BatchSeq, SequenceKv};
use baton_worker::model::dflash::{DflashFiles, DraftModel, TapProjection};
use baton_worker::model::{Scratch, StageWeights};
use baton_worker::ops::Ops;

/// Against transformers (float32 on another machine's kernels).
const TOL: f32 = 1e-4;
/// The context sum against the same taps' concatenation times `fc` (summation order only).
const SUM_TOL: f32 = 1e-5;

/// Every way to cut the tiny 3-layer model into stages.
const CUTS: [&[usize]; 4] = [&[], &[1], &[2], &[1, 2]];

/// The layer ranges of stages cut at `cuts`.
fn splits(cuts: &[usize], layers: usize) -> Vec<Range<usize>> {
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(layers);
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

struct Fixture {
    target: ModelFiles,
    cfg: ModelConfig,
    draft: DflashFiles,
    reference: serde_json::Value,
}

fn fixture() -> Fixture {
    let target = ModelFiles::open(&fixtures().join("tiny/qwen3")).unwrap();
    let cfg = target.config().unwrap();
    let dir = fixtures().join("tiny/qwen3_dflash");
    let draft = DflashFiles::open(&dir, &cfg).unwrap();
    let reference = read_json(&dir.join("reference.json"));
    Fixture {
        target,
        cfg,
        draft,
        reference,
    }
}

fn rows(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().flat_map(f32s).collect()
}

/// Run `tokens` through the stages `splits` in turn; each stage adds its taps to the sum.
fn run_split(f: &Fixture, tokens: &[u32], splits: &[Range<usize>]) -> (Vec<f32>, Vec<f32>) {
    let h = f.cfg.hidden_size;
    let mut hidden = vec![0f32; tokens.len() * h];
    let mut sum = vec![0f32; tokens.len() * h];
    for range in splits {
        let (first, last) = (range.start == 0, range.end == f.cfg.num_layers);
        let mut stage = StageWeights::load(&f.target, &f.cfg, range.clone(), first, last, true).unwrap();
        let taps = TapProjection::load(&stage.ops, &f.draft, range.clone()).unwrap();
        stage.set_taps(taps);
        if first {
            stage.embed(tokens, &mut hidden).unwrap();
        }
        let mut kv = SequenceKv::new(range.len(), f.cfg.kv_dim(), tokens.len());
        let mut batch = [BatchSeq {
            pos0: 0,
            len: tokens.len(),
            prompt_len: 0,
            kv: &mut kv,
        }];
        let mut s = Scratch::default();
        stage
            .forward_host_tapped(&mut hidden, Some(&mut sum), &mut AnyKv(&mut batch[..]), &mut s)
            .unwrap();
    }
    (hidden, sum)
}

/// The output of target layer `layer` for `tokens`: a stage ending after it.
fn layer_output(f: &Fixture, tokens: &[u32], layer: usize) -> Vec<f32> {
    let h = f.cfg.hidden_size;
    let stage = StageWeights::load(&f.target, &f.cfg, 0..layer + 1, true, false, true).unwrap();
    let mut hidden = vec![0f32; tokens.len() * h];
    stage.embed(tokens, &mut hidden).unwrap();
    let mut kv = SequenceKv::new(layer + 1, f.cfg.kv_dim(), tokens.len());
    stage.forward(&mut hidden, 0, &mut kv, &mut Scratch::default()).unwrap();
    hidden
}

#[test]
fn taps_are_the_tap_layers_outputs_as_transformers_computes_them() {
    let f = fixture();
    let tokens = ids(&f.reference["prompt"]);
    let layers = &f.draft.config.tap_layers;
    assert_eq!(layers, &[0, 1]);
    for (j, &l) in layers.iter().enumerate() {
        let got = layer_output(&f, &tokens, l);
        let want = rows(&f.reference["taps"][j]);
        let err = max_abs_diff(&got, &want);
        eprintln!("tap of layer {l}: max error {err:e}");
        assert!(err < TOL, "tap of layer {l}: max error {err}");
        // The off-by-one the design warns about is visible at this tolerance.
        let neighbour = layer_output(&f, &tokens, l + 1);
        assert!(max_abs_diff(&neighbour, &want) > 100.0 * TOL);
    }
}

#[test]
fn the_context_sum_equals_fc_of_the_concatenated_taps_for_every_split() {
    let f = fixture();
    let tokens = ids(&f.reference["prompt"]);
    let (h, t) = (f.cfg.hidden_size, tokens.len());
    let taps: Vec<Vec<f32>> = f
        .draft
        .config
        .tap_layers
        .iter()
        .map(|&l| layer_output(&f, &tokens, l))
        .collect();
    let fc = f.draft.files.load_f32(&f.draft.config.fc_spec(), true).unwrap();
    let width = taps.len() * h;
    // concat(taps) · fcᵀ in f64, from Baton's own taps.
    let mut want = vec![0f32; t * h];
    for r in 0..t {
        for o in 0..h {
            let mut acc = 0f64;
            for (j, tap) in taps.iter().enumerate() {
                for c in 0..h {
                    acc += tap[r * h + c] as f64 * fc[o * width + j * h + c] as f64;
                }
            }
            want[r * h + o] = acc as f32;
        }
    }
    let from_transformers = rows(&f.reference["context_fc"]);
    let whole = run_split(&f, &tokens, &splits(&[], 3));
    for cuts in CUTS {
        let splits = splits(cuts, 3);
        let (hidden, sum) = run_split(&f, &tokens, &splits);
        let err = max_abs_diff(&sum, &want);
        eprintln!("{splits:?}: context sum error {err:e}");
        assert!(err < SUM_TOL, "{splits:?}: context sum off by {err}");
        assert!(max_abs_diff(&sum, &from_transformers) < TOL, "{splits:?}");
        // Taps change nothing about the stages' own output.
        assert_eq!(hidden, whole.0, "{splits:?}");
    }
}

#[test]
fn the_draft_forward_equals_the_reference_implementation() {
    let f = fixture();
    let h = f.cfg.hidden_size;
    let target = StageWeights::load_full(&f.target, &f.cfg, true).unwrap();
    let draft = DraftModel::load(target.ops.clone(), &f.draft, &f.target, &f.cfg).unwrap();
    let b = draft.config.block_size;
    let context = rows(&f.reference["context_fc"]);
    let mut kv = SequenceKv::new(draft.num_layers(), draft.kv_dim(), 0);
    let mut s = Scratch::default();
    let mut head = Scratch::default();
    let mut have = 0;
    for (i, round) in f.reference["rounds"].as_array().unwrap().iter().enumerate() {
        let start = round["start"].as_u64().unwrap() as usize;
        // Context rows since the last round, then a block after them.
        draft.ops.upload(&context[have * h..start * h], &mut s.hidden);
        let mut ctx = [BatchSeq {
            pos0: have,
            len: start - have,
            prompt_len: 0,
            kv: &mut kv,
        }];
        draft.add_context(&mut AnyKv(&mut ctx[..]), &[0], &mut s).unwrap();
        have = start;
        let block = ids(&round["block"]);
        draft.embed_blocks(&block[..1], &mut s).unwrap();
        let mut blk = [BatchSeq {
            pos0: start,
            len: b,
            prompt_len: 0,
            kv: &mut kv,
        }];
        draft.run_blocks(&mut AnyKv(&mut blk[..]), &[0], &mut s).unwrap();
        kv.truncate(start);
        let got: Vec<f32> = s.xn.to_vec();
        let err = max_abs_diff(&got, &rows(&round["hidden"]));
        eprintln!("round {i}: draft hidden error {err:e}");
        assert!(err < TOL, "round {i}: draft hidden off by {err}");
        target.head_only_into(&got[h..], &mut head).unwrap();
        let logits: Vec<f32> = head.logits.to_vec();
        let err = max_abs_diff(&logits, &rows(&round["logits"]));
        assert!(err < TOL, "round {i}: draft logits off by {err}");
        let vocab = f.cfg.vocab_size;
        let picked: Vec<u32> = logits.chunks_exact(vocab).map(baton_worker::sampler::argmax).collect();
        assert_eq!(picked, ids(&round["proposals"]), "round {i}");
    }
}

#[test]
fn a_draft_that_does_not_fit_the_target_is_refused_by_name() {
    let f = fixture();
    let dir = fixtures().join("tiny/qwen3_dflash");
    // A target with fewer layers than the taps need, and one of another width.
    let mut short = f.cfg.clone();
    short.num_layers = 1;
    let e = DflashFiles::open(&dir, &short).unwrap_err().to_string();
    assert!(e.contains("tap layer 1") && e.contains("1 layers"), "{e}");
    let mut wide = f.cfg.clone();
    wide.hidden_size = 128;
    let e = DflashFiles::open(&dir, &wide).unwrap_err().to_string();
    assert!(e.contains("hidden size 64"), "{e}");
    // Not a draft at all: the target's own directory.
    let e = DflashFiles::open(&fixtures().join("tiny/qwen3"), &f.cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("DFlashDraftModel"), "{e}");
}

/// Stages over `splits` of the tiny Qwen3, each serving the draft (the last one runs it).
fn stages(f: &Fixture, splits: &[Range<usize>]) -> Vec<baton_worker::stage::Stage> {
    use baton_worker::backend::{self, BackendOptions, CpuOptions, Device};
    let draft = fixtures().join("tiny/qwen3_dflash");
    splits
        .iter()
        .enumerate()
        .map(|(i, range)| {
            let opts = BackendOptions {
                device: Device::Cpu { threads: Some(1) },
                format: baton_worker::model::WeightFormat::F32,
                cpu: CpuOptions::threads(1),
                check_finite: true,
                kv_blocks: 16,
                kv_block_size: 16,
                kv_dtype: baton_worker::kv_cache::KvDtype::F32,
                state_slots: 0,
                state_snapshots: 0,
            };
            let mut b = backend::load(&f.target, &f.cfg, range.clone(), &opts).unwrap();
            let runner = baton_worker::drafting::attach(&mut *b, &draft, &f.target, 1, None).unwrap();
            assert_eq!(runner.is_some(), range.end == f.cfg.num_layers);
            let mut stage = baton_worker::stage::Stage::new(b, i as u32, baton_shared::proto::Dtype::F32);
            stage.serve_draft(runner);
            stage
        })
        .collect()
}

/// One micro-batch through `stages` in turn (over the wire encoding between them).
fn step(
    stages: &mut [baton_worker::stage::Stage],
    batch: baton_shared::proto::MicroBatch,
) -> baton_shared::proto::BatchResult {
    use baton_worker::stage::StageOutput;
    let mut batch = batch;
    for stage in stages.iter_mut() {
        match stage.run(batch).unwrap() {
            StageOutput::Forward(next) => {
                // One f32 row of `hidden` per token travels, not one per tap layer.
                let rows: usize = next.seqs.iter().map(|c| c.tokens.len()).sum();
                let sum = next
                    .draft_context
                    .as_ref()
                    .expect("the context sum travels with the rows");
                assert_eq!(sum.data.len(), rows * 64 * 4);
                batch = next;
            }
            StageOutput::Sampled(result) => return result,
        }
    }
    unreachable!("the last stage samples")
}

#[test]
fn the_last_stage_drafts_the_same_proposals_through_every_split() {
    use baton_shared::proto::{MicroBatch, Sampling, SequenceChunk};
    let f = fixture();
    let prompt = ids(&f.reference["prompt"]);
    let chunk = |tokens: Vec<u32>, pos0: usize, sample: bool, draft: usize| SequenceChunk {
        seq_id: 7,
        tokens,
        pos0: pos0 as u32,
        sample,
        sampling: (pos0 == 0).then(Sampling::default),
        blocks: vec![0, 1],
        cached: 0,
        draft: draft as u32,
        taps: true,
        propose: if sample { 3 } else { 0 },
        restore_state: None,
        save_state: None,
        prompt_len: 0,
    };
    let batch = |c: SequenceChunk| MicroBatch {
        batch_id: 1,
        seqs: vec![c],
        ..Default::default()
    };
    // The target's own greedy continuation: proposing it every other step gets whole drafts
    // accepted, so the context also grows by several kept rows at once.
    let params = baton_shared::sampling::SamplingParams {
        ignore_eos: true,
        ..baton_shared::sampling::SamplingParams::greedy(40)
    };
    let mut engine = baton_worker::engine::Engine::new(StageWeights::load_full(&f.target, &f.cfg, true).unwrap());
    let want = engine.generate(&prompt, &params, None, |_| {}).unwrap().tokens;
    let mut runs = Vec::new();
    for cuts in CUTS {
        let splits = splits(cuts, 3);
        let mut st = stages(&f, &splits);
        // The prompt in two chunks (the first feeds the draft context only), then verify
        // steps that carry whatever the draft proposed.
        let mut trail = Vec::new();
        step(&mut st, batch(chunk(prompt[..5].to_vec(), 0, false, 0)));
        let mut r = step(&mut st, batch(chunk(prompt[5..].to_vec(), 5, true, 0)));
        let mut pos = prompt.len();
        let mut emitted: Vec<u32> = Vec::new();
        for i in 0..8 {
            let result = r.results.pop().unwrap();
            assert_eq!(result.proposals.len(), 3, "{splits:?}: block size 4 drafts 3");
            let mut tokens = vec![result.token];
            tokens.extend(&result.more_tokens);
            emitted.extend(&tokens);
            assert_eq!(emitted[..], want[..emitted.len()], "{splits:?}: greedy output");
            pos += tokens.len() - 1;
            let last = *tokens.last().unwrap();
            trail.push((tokens, result.proposals.clone()));
            let draft = match i % 2 {
                0 => result.proposals.clone(),
                _ => want[emitted.len()..emitted.len() + 3].to_vec(),
            };
            let mut verify = vec![last];
            verify.extend(&draft);
            r = step(&mut st, batch(chunk(verify, pos, true, 3)));
            pos += 1;
        }
        runs.push((splits, trail));
    }
    let (_, one) = &runs[0];
    eprintln!("one stage: {one:?}");
    for (splits, trail) in &runs[1..] {
        assert_eq!(trail, one, "{splits:?} against one stage");
    }
}
