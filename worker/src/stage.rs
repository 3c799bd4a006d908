//! A loaded pipeline stage: its weights, every sequence's KV for its layers, and (on the last
//! stage) each sequence's sampler. `run` takes one micro-batch through the layers.

use std::collections::HashMap;

use baton_shared::proto::{BatchResult, Dtype, MicroBatch, SequenceChunk, SequenceResult, StageInfo, Tensor};
use baton_shared::sampling::SamplingParams;
use baton_shared::wire;

use crate::kv_cache::SequenceKv;
use crate::model::{ForwardError, Scratch, StageWeights};
use crate::sampler::{Sampler, log_softmax_top};

/// What a micro-batch becomes after this stage.
#[derive(Debug)]
pub enum StageOutput {
    /// Hidden states for the next stage.
    Forward(MicroBatch),
    /// Sampled tokens (last stage).
    Sampled(BatchResult),
}

/// Per-sequence state on this stage.
struct SeqState {
    kv: SequenceKv,
    /// Last stage only.
    sampler: Option<Sampler>,
    logprobs: bool,
    top_logprobs: usize,
}

/// A stage with its sequences.
pub struct Stage {
    pub weights: StageWeights,
    pub stage_index: u32,
    activation_dtype: Dtype,
    seqs: HashMap<u64, SeqState>,
    scratch: Scratch,
    hidden: Vec<f32>,
    logits: Vec<f32>,
}

/// Bounds on what one micro-batch may ask for, so a bad message cannot exhaust memory.
const MAX_BATCH_TOKENS: usize = 1 << 16;
const MAX_TOP_LOGPROBS: usize = 20;

impl Stage {
    /// A stage over loaded weights.
    pub fn new(weights: StageWeights, stage_index: u32, activation_dtype: Dtype) -> Self {
        Self {
            weights,
            stage_index,
            activation_dtype,
            seqs: HashMap::new(),
            scratch: Scratch::default(),
            hidden: Vec::new(),
            logits: Vec::new(),
        }
    }

    /// Description for LoadStage/Health answers.
    pub fn info(&self) -> StageInfo {
        let w = &self.weights;
        StageInfo {
            layer_start: w.layers.start as u32,
            layer_end: w.layers.end as u32,
            num_layers: w.config.num_layers as u32,
            first: w.is_first,
            last: w.is_last,
            weight_bytes: w.weight_bytes() as u64,
        }
    }

    /// Sequences holding KV here, and the tokens they hold.
    pub fn usage(&self) -> (usize, usize) {
        (self.seqs.len(), self.seqs.values().map(|s| s.kv.len()).sum())
    }

    /// Keep the first `len` positions of a sequence; returns its new length, None if unknown.
    pub fn trim(&mut self, seq_id: u64, len: usize) -> Option<usize> {
        let seq = self.seqs.get_mut(&seq_id)?;
        seq.kv.truncate(len);
        Some(seq.kv.len())
    }

    /// Drop sequences; returns how many existed.
    pub fn free(&mut self, ids: &[u64]) -> usize {
        ids.iter().filter(|id| self.seqs.remove(id).is_some()).count()
    }

    fn err(&self, msg: impl std::fmt::Display) -> String {
        let l = &self.weights.layers;
        format!("stage {} (layers {}..{}): {msg}", self.stage_index, l.start, l.end)
    }

    /// Run one micro-batch through this stage's layers.
    pub fn run(&mut self, mut batch: MicroBatch) -> Result<StageOutput, String> {
        let h = self.weights.config.hidden_size;
        let total: usize = batch.seqs.iter().map(|s| s.tokens.len()).sum();
        if total == 0 || total > MAX_BATCH_TOKENS {
            return Err(self.err(format!(
                "micro-batch has {total} tokens (allowed 1..={MAX_BATCH_TOKENS})"
            )));
        }
        if batch.seqs.iter().any(|s| s.tokens.is_empty()) {
            return Err(self.err("a sequence chunk has no tokens"));
        }
        let mut hidden = std::mem::take(&mut self.hidden);
        let prepared = if self.weights.is_first {
            hidden.resize(total * h, 0.0);
            let tokens: Vec<u32> = batch.seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
            self.weights.embed(&tokens, &mut hidden).map_err(|e| self.err(e))
        } else {
            let t = batch.hidden.take().unwrap_or_default();
            wire::decode(&t, total, h, &mut hidden).map_err(|e| self.err(e))
        };
        let result = prepared.and_then(|()| self.run_layers(&batch.seqs, &mut hidden));
        let out = result.and_then(|()| {
            if self.weights.is_last {
                self.sample(&batch, &hidden).map(StageOutput::Sampled)
            } else {
                let mut t = Tensor::default();
                wire::encode(&hidden, total, h, self.activation_dtype, &mut t);
                batch.hidden = Some(t);
                Ok(StageOutput::Forward(batch))
            }
        });
        self.hidden = hidden;
        out
    }

    fn run_layers(&mut self, seqs: &[SequenceChunk], hidden: &mut [f32]) -> Result<(), String> {
        let h = self.weights.config.hidden_size;
        let c = &self.weights.config;
        let mut offset = 0;
        for chunk in seqs {
            let n = chunk.tokens.len();
            let pos0 = chunk.pos0 as usize;
            if pos0 == 0 {
                // A (re)started sequence: fresh KV, and on the last stage a fresh sampler.
                let sampling = chunk.sampling.unwrap_or_default();
                let params = SamplingParams {
                    temperature: sampling.temperature,
                    top_k: sampling.top_k as usize,
                    top_p: if sampling.top_p > 0.0 { sampling.top_p } else { 1.0 },
                    min_p: sampling.min_p,
                    seed: sampling.seed,
                    ..SamplingParams::default()
                };
                let state = SeqState {
                    kv: SequenceKv::new(self.weights.layers.len(), c.kv_dim(), n),
                    sampler: self.weights.is_last.then(|| Sampler::new(&params)),
                    logprobs: sampling.logprobs,
                    top_logprobs: (sampling.top_logprobs as usize).min(MAX_TOP_LOGPROBS),
                };
                self.seqs.insert(chunk.seq_id, state);
            }
            let Some(seq) = self.seqs.get_mut(&chunk.seq_id) else {
                return Err(format!(
                    "stage {}: unknown sequence {} at position {pos0} (never started, or freed)",
                    self.stage_index, chunk.seq_id
                ));
            };
            let rows = &mut hidden[offset * h..(offset + n) * h];
            if let Err(e) = self.weights.forward(rows, pos0, &mut seq.kv, &mut self.scratch) {
                let msg = format!("sequence {}: {e}", chunk.seq_id);
                if matches!(e, ForwardError::KvPosition { .. }) {
                    self.seqs.remove(&chunk.seq_id);
                }
                return Err(self.err(msg));
            }
            offset += n;
        }
        Ok(())
    }

    fn sample(&mut self, batch: &MicroBatch, hidden: &[f32]) -> Result<BatchResult, String> {
        let h = self.weights.config.hidden_size;
        let vocab = self.weights.config.vocab_size;
        self.logits.resize(vocab, 0.0);
        let mut results = Vec::new();
        let mut offset = 0;
        for chunk in &batch.seqs {
            offset += chunk.tokens.len();
            if !chunk.sample {
                continue;
            }
            let row = &hidden[(offset - 1) * h..offset * h];
            self.weights
                .logits(row, &mut self.scratch, &mut self.logits)
                .map_err(|e| self.err(e))?;
            let seq = self
                .seqs
                .get_mut(&chunk.seq_id)
                .ok_or_else(|| format!("sequence {} vanished", chunk.seq_id))?;
            let sampler = seq
                .sampler
                .as_mut()
                .ok_or_else(|| format!("sequence {} has no sampler", chunk.seq_id))?;
            let token = sampler.sample(&self.logits);
            let mut r = SequenceResult {
                seq_id: chunk.seq_id,
                token,
                ..Default::default()
            };
            if seq.logprobs {
                let lp = log_softmax_top(&self.logits, token, seq.top_logprobs);
                r.logprob = lp.0;
                (r.top_ids, r.top_logprobs) = lp.1.into_iter().unzip();
            }
            results.push(r);
        }
        Ok(BatchResult {
            batch_id: batch.batch_id,
            results,
            error: String::new(),
        })
    }
}
