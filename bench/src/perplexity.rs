//! Perplexity of a text under each weight format, and its change from f32: the quality cost of
//! a format in one number. The text is cut into non-overlapping windows of `context` tokens;
//! every token after a window's first is scored given the tokens before it in that window.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use baton_shared::fetch::{Sources, baton_home};
use baton_shared::model_source::{LoadedModel, resolve_model};
use baton_worker::engine::Engine;
use baton_worker::kernels::cpu::matmul::WeightFormat;
use baton_worker::model::{LoadOptions, StageWeights};

/// Mean negative log-likelihood (nats per token) and the number of tokens scored.
fn mean_nll(engine: &mut Engine, tokens: &[u32], context: usize, vocab: usize) -> Result<(f64, usize)> {
    let (mut nll, mut scored) = (0f64, 0usize);
    for window in tokens.chunks(context).filter(|w| w.len() > 1) {
        let logits = engine.prompt_logits(window, true)?;
        for (row, &next) in logits.chunks_exact(vocab).zip(&window[1..]) {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let log_sum = row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
            nll += log_sum - row[next as usize] as f64;
            scored += 1;
        }
    }
    Ok((nll / scored.max(1) as f64, scored))
}

/// Print one JSON line per format: perplexity, and its relative change from f32.
pub fn run(model: Option<String>, text: &Path, context: usize, weights: &[WeightFormat], threads: usize) -> Result<()> {
    if context < 2 {
        bail!("--context must be at least 2 tokens");
    }
    let path = resolve_model(model.as_deref(), &baton_home(), &Sources::default(), true)?;
    let model = LoadedModel::open(&path).with_context(|| path.display().to_string())?;
    let body = std::fs::read_to_string(text).with_context(|| format!("reading {}", text.display()))?;
    let tokens = model.tokenizer.encode(&body, false)?;
    let mut formats = vec![WeightFormat::F32];
    formats.extend(weights.iter().filter(|&&w| w != WeightFormat::F32));
    let mut base = None;
    for format in formats {
        let opts = LoadOptions {
            format,
            threads,
            kernels: None,
        };
        let mut engine = Engine::new(StageWeights::load_full_with(&model.files, &model.config, false, &opts)?);
        let start = Instant::now();
        let (nll, scored) = mean_nll(&mut engine, &tokens, context, model.config.vocab_size)?;
        let ppl = nll.exp();
        let base_ppl = *base.get_or_insert(ppl);
        let line = serde_json::json!({
            "weights": format.name(),
            "perplexity": ppl,
            "delta_vs_f32_percent": 100.0 * (ppl / base_ppl - 1.0),
            "tokens_scored": scored,
            "context": context,
            "text": text.display().to_string(),
            "matrix_bytes": engine.weights.matrix_bytes(),
            "seconds": start.elapsed().as_secs_f64(),
        });
        println!("{line}");
    }
    Ok(())
}
