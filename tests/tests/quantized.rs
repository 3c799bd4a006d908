//! The fast CPU path on SmolLM2: f32 weights through the SIMD kernels and the thread pool give
//! the reference logits bit for bit; Q8_0 weights stay close to fp32 and keep greedy answers.

use baton_shared::model_source::LoadedModel;
use baton_shared::sampling::SamplingParams;
use baton_tests::{default_model, fixtures, ids, max_abs_diff, read_json};
use baton_worker::engine::Engine;
use baton_worker::kernels::cpu::matmul::WeightFormat;
use baton_worker::model::{LoadOptions, StageWeights};

/// Q8_0 vs fp32: largest logit difference allowed, relative to the fp32 logits' spread (max −
/// min over the vocabulary). Measured on these prompts: 2.3–3.7% (max abs 0.85–1.45).
const Q8_REL_TOL: f32 = 0.05;

fn engine(model: &LoadedModel, format: WeightFormat, threads: usize) -> Engine {
    let opts = LoadOptions {
        format,
        threads,
        kernels: None,
    };
    Engine::new(StageWeights::load_full_with(&model.files, &model.config, true, &opts).unwrap())
}

fn prompts() -> Vec<Vec<u32>> {
    let fx = read_json(&fixtures().join("smollm2/logits.json"));
    fx["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| ids(&p["ids"]))
        .collect()
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
        .unwrap()
}

#[test]
fn f32_fast_path_equals_the_reference_for_any_thread_count() {
    let model = LoadedModel::open(&default_model()).unwrap();
    let mut reference = Engine::new(StageWeights::load_full(&model.files, &model.config, true).unwrap());
    let mut fast = engine(&model, WeightFormat::F32, 2);
    for tokens in prompts() {
        let want = reference.prompt_logits(&tokens, true).unwrap();
        assert_eq!(fast.prompt_logits(&tokens, true).unwrap(), want, "{tokens:?}");
    }
}

#[test]
fn q8_0_logits_stay_close_to_fp32_and_do_not_depend_on_threads() {
    let model = LoadedModel::open(&default_model()).unwrap();
    let mut fp32 = engine(&model, WeightFormat::F32, 1);
    let mut q1 = engine(&model, WeightFormat::Q8_0, 1);
    let mut q3 = engine(&model, WeightFormat::Q8_0, 3);
    assert!(q1.weights.matrix_bytes() * 3 < fp32.weights.matrix_bytes());
    for tokens in prompts() {
        let want = fp32.prompt_logits(&tokens, false).unwrap();
        let got = q1.prompt_logits(&tokens, false).unwrap();
        assert_eq!(q3.prompt_logits(&tokens, false).unwrap(), got, "1 vs 3 threads");
        let spread = want.iter().fold(f32::MIN, |m, &v| m.max(v)) - want.iter().fold(f32::MAX, |m, &v| m.min(v));
        let err = max_abs_diff(&got, &want);
        eprintln!(
            "Q8_0 vs fp32 {tokens:?}: max |logit error| {err:.4} = {:.2}% of the spread {spread:.2}",
            100.0 * err / spread
        );
        assert!(err < Q8_REL_TOL * spread, "max |logit error| {err} vs spread {spread}");
        assert_eq!(argmax(&got), argmax(&want), "top-1 token");
    }
}

#[test]
fn q8_0_greedy_answer_is_still_paris() {
    let model = LoadedModel::open(&default_model()).unwrap();
    let mut q8 = engine(&model, WeightFormat::Q8_0, 2);
    let prompt = model.tokenizer.encode("The capital of France is", true).unwrap();
    let out = q8
        .generate(&prompt, &SamplingParams::greedy(8), Some(&model.tokenizer), |_| {})
        .unwrap();
    eprintln!("Q8_0 greedy: {:?}", out.text);
    assert!(out.text.contains("Paris"), "{:?}", out.text);
}
