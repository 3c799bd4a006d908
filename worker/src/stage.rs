//! A loaded pipeline stage: its [`Backend`] (weights and the KV of its layers on some device),
//! the sequences it holds KV for, and (on the last stage) each sequence's sampler. `run` takes
//! one micro-batch through the layers.

use std::collections::HashMap;

use baton_shared::proto::{
    BatchResult, Dtype, HealthResponse, MicroBatch, SequenceChunk, SequenceResult, StageInfo, Tensor, TokenLogprobs,
};
use baton_shared::sampling::SamplingParams;
use baton_shared::wire;

use crate::backend::{Backend, SampleSlot, SeqChunk};
use crate::drafting::{DraftRunner, DraftWork};
use crate::kv_cache::delta_windows;
use crate::model::ForwardError;
use crate::sampler::Sampler;

/// What a micro-batch becomes after this stage.
#[derive(Debug)]
pub enum StageOutput {
    /// Hidden states for the next stage.
    Forward(MicroBatch),
    /// Sampled tokens (last stage).
    Sampled(BatchResult),
}

/// Per-sequence state on this stage (its K/V live in the pool, under its block table).
struct SeqState {
    /// Positions stored.
    len: usize,
    /// Of those, the last ones that were proposals (the sequence's latest chunk carried a
    /// draft): the next chunk may start among them, dropping the rejected ones.
    unverified: usize,
    /// Its recurrent-state slot (0 on a stage without linear-attention layers).
    state_slot: usize,
    /// On a stage with recurrent state, what undoes the latest verify chunk's rejected
    /// proposals (kept once allocated, so later drafts reuse its buffers).
    rollback: Option<Box<Rollback>>,
    /// Last stage only.
    sampler: Option<Sampler>,
    logprobs: bool,
    top_logprobs: usize,
}

/// A recurrent state cannot drop positions the way K/V can, so before a chunk with proposals
/// runs, a stage with linear-attention layers keeps the sequence's state and the chunk's input
/// rows. When the next chunk shows some proposals were rejected, the stage puts the state back
/// and runs the accepted rows again: the state then holds exactly the kept positions, computed
/// as they were the first time (each row's result does not depend on its batch), and their
/// K/V is rewritten with the same values.
#[derive(Default)]
struct Rollback {
    /// Where the verify chunk started.
    pos0: usize,
    /// The chunk's input rows (`tokens × hidden`).
    hidden: Vec<f32>,
    /// The sequence's state before the chunk.
    state: Vec<f32>,
    /// Whether it holds a chunk not yet settled.
    armed: bool,
}

/// Work a stage has done since it was loaded.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct ForwardTotals {
    pub batches: u64,
    pub tokens: u64,
    pub seconds: f64,
}

impl ForwardTotals {
    /// Count one micro-batch of `tokens` that took `seconds`.
    pub fn record(&mut self, tokens: usize, seconds: f64) {
        self.batches += 1;
        self.tokens += tokens as u64;
        self.seconds += seconds;
    }
}

/// The `stage.forward` span of one micro-batch on the worker `worker_id`, a child of the
/// trace context the batch carries; [`Stage::run_observed`] fills in the stage and its layers.
pub fn forward_span(worker_id: &str, batch: &MicroBatch) -> tracing::Span {
    let span = tracing::info_span!(
        "stage.forward",
        stage = tracing::field::Empty,
        worker_id = %worker_id,
        layer_start = tracing::field::Empty,
        layer_end = tracing::field::Empty,
        batch_id = batch.batch_id,
        batch_tokens = batch.seqs.iter().map(|s| s.tokens.len()).sum::<usize>(),
        draft_tokens = batch.seqs.iter().map(|s| s.draft as usize).sum::<usize>(),
        sequences = batch.seqs.len(),
        moe_active_experts = tracing::field::Empty,
    );
    baton_shared::trace_context::set_parent(&span, &batch.trace_context);
    span
}

/// A stage with its sequences.
pub struct Stage {
    backend: Box<dyn Backend>,
    pub stage_index: u32,
    /// Reported by Health, so the coordinator can show per-stage latency.
    pub totals: ForwardTotals,
    activation_dtype: Dtype,
    seqs: HashMap<u64, SeqState>,
    hidden: Vec<f32>,
    /// Last rows of the sequences sampled in a batch (reused).
    sample_rows: Vec<f32>,
    /// One slot per sampled row (reused).
    slots: Vec<SampleSlot>,
    /// Whether a DFlash draft is served: this stage adds its taps to the context sum.
    drafting: bool,
    /// The draft itself (last stage).
    draft: Option<DraftRunner>,
    /// The context sum of the current micro-batch (reused).
    taps: Vec<f32>,
    /// Recurrent-state slots no sequence holds (empty, and never used, on a stage without
    /// linear-attention layers).
    free_state_slots: Vec<usize>,
    /// Whether the layers here keep recurrent state (rolled back by replay: see [`Rollback`]).
    recurrent: bool,
    /// Rows a rollback runs again (reused).
    replay_rows: Vec<f32>,
}

/// Bounds on what one micro-batch may ask for, so a bad message cannot exhaust memory.
const MAX_BATCH_TOKENS: usize = 1 << 16;
const MAX_TOP_LOGPROBS: usize = 20;
/// Most proposals one chunk may carry.
pub const MAX_DRAFT_TOKENS: usize = 64;

impl Stage {
    /// A stage over a loaded backend; hidden states leave it as `activation_dtype`.
    pub fn new(backend: Box<dyn Backend>, stage_index: u32, activation_dtype: Dtype) -> Self {
        let slots = backend.kv().state_slots;
        Self {
            free_state_slots: (0..slots).rev().collect(),
            recurrent: slots > 0,
            backend,
            stage_index,
            totals: ForwardTotals::default(),
            activation_dtype,
            seqs: HashMap::new(),
            hidden: Vec::new(),
            sample_rows: Vec::new(),
            slots: Vec::new(),
            drafting: false,
            draft: None,
            taps: Vec::new(),
            replay_rows: Vec::new(),
        }
    }

    /// Serve a DFlash draft: this stage's tap blocks are loaded in its backend, and the last
    /// stage brings the draft (`runner`).
    pub fn serve_draft(&mut self, runner: Option<DraftRunner>) {
        self.drafting = true;
        self.draft = runner;
    }

    /// Description for LoadStage/Health answers.
    pub fn info(&self) -> StageInfo {
        let s = self.backend.shape();
        StageInfo {
            layer_start: s.layers.start as u32,
            layer_end: s.layers.end as u32,
            num_layers: s.config.num_layers as u32,
            first: s.first,
            last: s.last,
            weight_bytes: self.backend.info().weight_bytes as u64,
        }
    }

    /// The backend the stage runs on.
    pub fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// Sequences holding KV here, and the positions they hold.
    pub fn usage(&self) -> (usize, usize) {
        (self.seqs.len(), self.seqs.values().map(|s| s.len).sum())
    }

    /// KV positions the pool has room for, and the bytes it reserves.
    pub fn kv_reserved(&self) -> (usize, usize) {
        let kv = self.backend.kv();
        (kv.blocks * kv.block_size, kv.bytes)
    }

    /// Blocks the live sequences' positions cover, and blocks in the pool.
    pub fn kv_blocks(&self) -> (usize, usize) {
        let kv = self.backend.kv();
        let used = self.seqs.values().map(|s| s.len.div_ceil(kv.block_size)).sum();
        (used, kv.blocks)
    }

    /// Keep the first `len` positions of a sequence; returns its new length, None if unknown.
    /// Recurrent state cannot be cut back, so on a stage that keeps it a shorter length drops
    /// the sequence (it holds 0 positions; its next chunk must start it again).
    pub fn trim(&mut self, seq_id: u64, len: usize) -> Option<usize> {
        if self.recurrent && self.seqs.get(&seq_id)?.len > len {
            self.forget(seq_id);
            return Some(0);
        }
        let seq = self.seqs.get_mut(&seq_id)?;
        seq.len = seq.len.min(len);
        seq.unverified = seq.unverified.min(seq.len);
        Some(seq.len)
    }

    /// Drop sequences; returns how many existed.
    pub fn free(&mut self, ids: &[u64]) -> usize {
        if let Some(d) = &mut self.draft {
            d.forget(ids);
        }
        ids.iter().filter(|&&id| self.forget(id)).count()
    }

    /// Drop one sequence and give back its state slot; whether it existed.
    fn forget(&mut self, id: u64) -> bool {
        match self.seqs.remove(&id) {
            Some(s) => {
                if self.recurrent {
                    self.free_state_slots.push(s.state_slot);
                }
                true
            }
            None => false,
        }
    }

    fn err(&self, msg: impl std::fmt::Display) -> String {
        let l = &self.backend.shape().layers;
        format!("stage {} (layers {}..{}): {msg}", self.stage_index, l.start, l.end)
    }

    /// Run one micro-batch under `span` (see [`forward_span`]), with the stage's metrics:
    /// forward time, batch tokens, transfer bytes and errors per stage, and what it holds.
    pub fn run_observed(&mut self, batch: MicroBatch, span: &tracing::Span) -> Result<StageOutput, String> {
        let tokens: usize = batch.seqs.iter().map(|s| s.tokens.len()).sum();
        let info = self.info();
        span.record("stage", self.stage_index);
        span.record("layer_start", info.layer_start);
        span.record("layer_end", info.layer_end);
        let _entered = span.enter();
        // How long this stage's input took to arrive (from the coordinator or the previous stage).
        if let Some(hop) = wire::hop_seconds(batch.sent_unix_nanos) {
            metrics::histogram!("baton_transfer_seconds", "stage" => self.stage_index.to_string()).record(hop);
        }
        let started = std::time::Instant::now();
        let out = self.run(batch);
        let seconds = started.elapsed().as_secs_f64();
        self.totals.record(tokens, seconds);
        let label = [("stage", self.stage_index.to_string())];
        metrics::histogram!("baton_stage_forward_seconds", &label).record(seconds);
        metrics::histogram!("baton_stage_batch_tokens", &label).record(tokens as f64);
        if let Ok(StageOutput::Forward(mb)) = &out {
            let bytes = mb.hidden.as_ref().map_or(0, |t| t.data.len());
            metrics::counter!("baton_transfer_bytes_total", &label).increment(bytes as u64);
            if let Some(t) = &mb.draft_context {
                metrics::counter!("baton_spec_tap_bytes_total", &label).increment(t.data.len() as u64);
            }
        }
        if out.is_err() {
            metrics::counter!("baton_stage_errors_total", &label).increment(1);
        }
        self.record_usage();
        out
    }

    /// Gauges of what this stage holds.
    pub fn record_usage(&self) {
        let (seqs, kv_tokens) = self.usage();
        let (used, total) = self.kv_blocks();
        metrics::gauge!("baton_worker_sequences").set(seqs as f64);
        metrics::gauge!("baton_worker_kv_tokens").set(kv_tokens as f64);
        metrics::gauge!("baton_worker_kv_blocks_used").set(used as f64);
        metrics::gauge!("baton_worker_kv_blocks_total").set(total as f64);
        let (used, total) = self.state_slots();
        metrics::gauge!("baton_worker_state_slots_used").set(used as f64);
        metrics::gauge!("baton_worker_state_slots_total").set(total as f64);
        metrics::gauge!("baton_worker_state_snapshots_total").set(self.backend.kv().state_snapshots as f64);
    }

    /// Recurrent-state slots held by live sequences, and the slots there are.
    pub fn state_slots(&self) -> (usize, usize) {
        let total = self.backend.kv().state_slots;
        (total - self.free_state_slots.len().min(total), total)
    }

    /// The load numbers a Health answer reports (the worker id is the caller's to fill in).
    pub fn health(&self) -> HealthResponse {
        let (active, kv) = self.usage();
        let (kv_capacity, kv_bytes) = self.kv_reserved();
        let (blocks_used, blocks_total) = self.kv_blocks();
        let (slots_used, slots_total) = self.state_slots();
        HealthResponse {
            loaded: true,
            stage: Some(self.info()),
            active_sequences: active as u32,
            kv_tokens: kv as u64,
            forward_batches: self.totals.batches,
            forward_tokens: self.totals.tokens,
            forward_seconds: self.totals.seconds,
            kv_capacity_tokens: kv_capacity as u64,
            kv_bytes: kv_bytes as u64,
            kv_blocks_used: blocks_used as u64,
            kv_blocks_total: blocks_total as u64,
            state_slots_used: slots_used as u32,
            state_slots_total: slots_total as u32,
            state_snapshots_total: self.backend.kv().state_snapshots as u32,
            ..Default::default()
        }
    }

    /// Run one micro-batch through this stage's layers.
    pub fn run(&mut self, mut batch: MicroBatch) -> Result<StageOutput, String> {
        if !batch.free.is_empty() {
            // Freed before this batch was sent: their Free RPC may not have arrived yet.
            self.free(&batch.free);
        }
        let shape = self.backend.shape();
        let (h, first, last) = (shape.config.hidden_size, shape.first, shape.last);
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
        let prepared = if first {
            hidden.resize(total * h, 0.0);
            let tokens: Vec<u32> = batch.seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
            self.backend.embed(&tokens, &mut hidden).map_err(|e| self.err(e))
        } else {
            let t = batch.hidden.take().unwrap_or_default();
            wire::decode(&t, total, h, &mut hidden).map_err(|e| self.err(e))
        };
        let mut taps = std::mem::take(&mut self.taps);
        let tapped = batch.seqs.iter().any(|s| s.taps);
        let prepared = prepared.and_then(|()| match tapped {
            false => Ok(()),
            true => self.start_taps(&mut batch, first, total, h, &mut taps),
        });
        let result = prepared.and_then(|()| self.run_layers(&batch.seqs, &mut hidden, tapped.then_some(&mut taps[..])));
        let out = result.and_then(|()| {
            if last {
                let mut sampled = self.sample(&batch, &hidden)?;
                if tapped || batch.seqs.iter().any(|c| c.propose > 0) {
                    self.draft_step(&batch, &taps, &mut sampled)?;
                }
                Ok(StageOutput::Sampled(sampled))
            } else {
                let mut t = Tensor::default();
                wire::encode(&hidden, total, h, self.activation_dtype, &mut t);
                batch.hidden = Some(t);
                if tapped {
                    // The context sum stays f32: it is exact up to summation order.
                    let mut c = Tensor::default();
                    wire::encode(&taps, total, h, Dtype::F32, &mut c);
                    batch.draft_context = Some(c);
                }
                Ok(StageOutput::Forward(batch))
            }
        });
        self.hidden = hidden;
        self.taps = taps;
        out
    }

    /// The context sum this stage adds its taps to: zeros on the first stage, what the
    /// previous stage sent otherwise.
    fn start_taps(
        &self,
        batch: &mut MicroBatch,
        first: bool,
        total: usize,
        h: usize,
        taps: &mut Vec<f32>,
    ) -> Result<(), String> {
        if !self.drafting {
            return Err(self.err("a chunk asks for DFlash taps, but this stage serves no draft (--draft-model)"));
        }
        match batch.draft_context.take() {
            Some(t) if !first => wire::decode(&t, total, h, taps).map_err(|e| self.err(format!("draft context: {e}"))),
            Some(_) => Err(self.err("the first stage got a draft context; it starts the sum itself")),
            None if first => {
                taps.clear();
                taps.resize(total * h, 0.0);
                Ok(())
            }
            None => Err(self.err("a chunk asks for DFlash taps, but the micro-batch carries no draft context")),
        }
    }

    /// Feed each tapped chunk's kept rows to its sequence's draft context and draft the
    /// proposals chunks ask for, into their results.
    fn draft_step(&mut self, batch: &MicroBatch, taps: &[f32], sampled: &mut BatchResult) -> Result<(), String> {
        let h = self.backend.shape().config.hidden_size;
        if self.draft.is_none() {
            return Err(self.err("a chunk asks for DFlash proposals, but this stage serves no draft (--draft-model)"));
        }
        let mut work = Vec::new();
        let mut result_of = Vec::new();
        let mut offset = 0;
        for chunk in &batch.seqs {
            let n = chunk.tokens.len();
            let rows = offset..offset + n;
            offset += n;
            let result = sampled.results.iter().position(|r| r.seq_id == chunk.seq_id);
            // Rows kept: all of a prompt chunk; of a verify step, those before the draft and
            // the accepted proposals.
            let (kept, anchor) = match (chunk.sample, result) {
                (true, Some(i)) => {
                    let r = &sampled.results[i];
                    let accepted = r.more_tokens.len();
                    (
                        n - chunk.draft as usize + accepted,
                        *r.more_tokens.last().unwrap_or(&r.token),
                    )
                }
                _ => (n, 0),
            };
            let context = match chunk.taps {
                true => &taps[rows.start * h..(rows.start + kept) * h],
                false => &taps[..0],
            };
            let propose = match result {
                Some(_) => chunk.propose as usize,
                None => 0,
            };
            if context.is_empty() && propose == 0 {
                continue;
            }
            work.push(DraftWork {
                seq_id: chunk.seq_id,
                start: chunk.pos0 as usize,
                context,
                anchor,
                propose,
            });
            result_of.push(result);
        }
        let mut proposals = Vec::new();
        let runner = self.draft.as_mut().expect("checked above");
        let stepped = runner.step(&work, &mut *self.backend, &mut proposals);
        metrics::gauge!("baton_spec_draft_context_bytes").set(runner.context_bytes() as f64);
        stepped.map_err(|e| self.err(format!("DFlash draft: {e}")))?;
        for (r, p) in result_of.into_iter().zip(proposals) {
            if let Some(i) = r {
                sampled.results[i].proposals = p;
            }
        }
        Ok(())
    }

    /// Run every chunk's rows through the layers as one batch (each weight matrix read once
    /// for the whole micro-batch), after checking each sequence can take its chunk.
    fn run_layers(
        &mut self,
        seqs: &[SequenceChunk],
        hidden: &mut [f32],
        taps: Option<&mut [f32]>,
    ) -> Result<(), String> {
        let shape = self.backend.shape();
        let (max_ctx, last) = (shape.config.max_position_embeddings, shape.last);
        for (i, chunk) in seqs.iter().enumerate() {
            if seqs[..i].iter().any(|o| o.seq_id == chunk.seq_id) {
                return Err(self.err(format!("sequence {} appears twice in one micro-batch", chunk.seq_id)));
            }
        }
        for chunk in seqs {
            let n = chunk.tokens.len();
            let pos0 = chunk.pos0 as usize;
            if pos0 + n > max_ctx {
                let e = ForwardError::ContextOverflow {
                    needed: pos0 + n,
                    max: max_ctx,
                };
                return Err(self.err(format!("sequence {}: {e}", chunk.seq_id)));
            }
            let draft = chunk.draft as usize;
            if draft > 0 && (draft >= n || draft > MAX_DRAFT_TOKENS || !chunk.sample) {
                return Err(self.err(format!(
                    "sequence {}: a draft of {draft} proposals needs a sampling chunk of more tokens, and at most {MAX_DRAFT_TOKENS}",
                    chunk.seq_id
                )));
            }
            let cached = chunk.cached as usize;
            if cached != 0 && cached != pos0 {
                return Err(self.err(format!(
                    "sequence {}: a chunk reusing {cached} cached positions must start at position {cached}, not {pos0}",
                    chunk.seq_id
                )));
            }
            if pos0 == 0 || cached != 0 {
                // A (re)started sequence: fresh KV after any reused prefix (its positions are
                // already in the table's blocks), and on the last stage a fresh sampler.
                let sampling = chunk.sampling.unwrap_or_default();
                let params = SamplingParams {
                    temperature: sampling.temperature,
                    top_k: sampling.top_k as usize,
                    top_p: if sampling.top_p > 0.0 { sampling.top_p } else { 1.0 },
                    min_p: sampling.min_p,
                    seed: sampling.seed,
                    ..SamplingParams::default()
                };
                let restore = match (self.recurrent && cached != 0, chunk.restore_state) {
                    (true, None) => {
                        return Err(self.err(format!(
                            "sequence {}: a cached prefix of {cached} positions needs a recurrent-state snapshot to \
                             start from on a stage with linear-attention layers, and the chunk names none",
                            chunk.seq_id
                        )));
                    }
                    (true, Some(snapshot)) => Some(snapshot as usize),
                    (false, _) => None,
                };
                // A restarted sequence keeps its slot; a new one takes a free one.
                let state_slot = match self.seqs.get(&chunk.seq_id) {
                    Some(old) => old.state_slot,
                    None if !self.recurrent => 0,
                    None => match self.free_state_slots.pop() {
                        Some(slot) => slot,
                        None => {
                            return Err(self.err(format!(
                                "sequence {}: all {} recurrent-state slots are in use",
                                chunk.seq_id,
                                self.backend.kv().state_slots
                            )));
                        }
                    },
                };
                if let Some(snapshot) = restore {
                    if let Err(e) = self.backend.load_snapshot(snapshot, state_slot) {
                        if !self.seqs.contains_key(&chunk.seq_id) {
                            self.free_state_slots.push(state_slot);
                        }
                        return Err(self.err(format!("sequence {}: {e}", chunk.seq_id)));
                    }
                    let label = [("stage", self.stage_index.to_string())];
                    metrics::counter!("baton_worker_state_snapshots_restored_total", &label).increment(1);
                }
                let state = SeqState {
                    len: cached,
                    unverified: 0,
                    state_slot,
                    rollback: None,
                    sampler: last.then(|| {
                        let mut sampler = Sampler::new(&params);
                        sampler.skip(sampling.drawn);
                        sampler
                    }),
                    logprobs: sampling.logprobs,
                    top_logprobs: (sampling.top_logprobs as usize).min(MAX_TOP_LOGPROBS),
                };
                self.seqs.insert(chunk.seq_id, state);
                if let Some(d) = &mut self.draft {
                    d.forget(&[chunk.seq_id]);
                }
            }
            let Some(seq) = self.seqs.get_mut(&chunk.seq_id) else {
                return Err(format!(
                    "stage {}: unknown sequence {} at position {pos0} (never started, or freed)",
                    self.stage_index, chunk.seq_id
                ));
            };
            let mut replay = None;
            if pos0 < seq.len && seq.len - pos0 <= seq.unverified {
                // After a verified draft: the chunk starts after the accepted proposals, so the
                // rejected ones' K/V (at pos0 and later) is dropped; the chunk overwrites it.
                // A recurrent state has absorbed them too: it is rebuilt from before the draft.
                seq.len = pos0;
                if self.recurrent {
                    replay = Some((seq.state_slot, seq.rollback.take()));
                }
            }
            if seq.len != pos0 {
                let e = ForwardError::KvPosition { have: seq.len, pos0 };
                // Its KV no longer matches what the coordinator believes: drop the sequence.
                self.forget(chunk.seq_id);
                return Err(self.err(format!("sequence {}: {e}", chunk.seq_id)));
            }
            if let Some((slot, rollback)) = replay {
                let replayed = self.replay(chunk, slot, rollback);
                if let Err(e) = replayed {
                    self.forget(chunk.seq_id);
                    return Err(self.err(format!("sequence {}: {e}", chunk.seq_id)));
                }
            }
        }
        if self.recurrent {
            self.keep_rollbacks(seqs, hidden).map_err(|e| self.err(e))?;
        }
        let batch: Vec<SeqChunk<'_>> = seqs
            .iter()
            .map(|chunk| SeqChunk {
                pos0: chunk.pos0 as usize,
                len: chunk.tokens.len(),
                // The real length, so the forward pass checks positions against the state.
                stored: self.seqs.get(&chunk.seq_id).map_or(0, |s| s.len),
                table: &chunk.blocks,
                state_slot: self.seqs.get(&chunk.seq_id).map_or(0, |s| s.state_slot),
                prompt_len: chunk.prompt_len as usize,
            })
            .collect();
        let ran = match taps {
            Some(taps) => self.backend.forward_tapped(hidden, &batch, taps),
            None => self.backend.forward(hidden, &batch),
        };
        if let Err(e) = ran {
            return Err(self.err(e));
        }
        for chunk in seqs {
            if let Some(seq) = self.seqs.get_mut(&chunk.seq_id) {
                seq.len = chunk.pos0 as usize + chunk.tokens.len();
                seq.unverified = chunk.draft as usize;
            }
        }
        if self.recurrent {
            // How the delta rule ran: whole prompt windows in the chunked form, the rest token
            // by token (a prefill that shows no chunked rows was cut off its windows).
            let (rows, windowed) = seqs.iter().fold((0, 0), |(r, w), c| {
                let (pos0, len) = (c.pos0 as usize, c.tokens.len());
                (r + len, w + delta_windows(pos0, len, c.prompt_len as usize).len())
            });
            let stage = self.stage_index.to_string();
            let chunked = [("stage", stage.clone()), ("form", "chunked".to_string())];
            metrics::counter!("baton_worker_delta_rule_tokens_total", &chunked).increment(windowed as u64);
            let step = [("stage", stage), ("form", "step".to_string())];
            metrics::counter!("baton_worker_delta_rule_tokens_total", &step).increment((rows - windowed) as u64);
            self.save_snapshots(seqs)?;
        }
        Ok(())
    }

    /// After a micro-batch ran on a stage with recurrent state: copy the state of each
    /// sequence whose chunk asks for it into that prefix-cache snapshot.
    fn save_snapshots(&mut self, seqs: &[SequenceChunk]) -> Result<(), String> {
        for chunk in seqs {
            let (Some(snapshot), Some(seq)) = (chunk.save_state, self.seqs.get(&chunk.seq_id)) else {
                continue;
            };
            if let Err(e) = self.backend.save_snapshot(seq.state_slot, snapshot as usize) {
                return Err(self.err(format!("sequence {}: {e}", chunk.seq_id)));
            }
            let label = [("stage", self.stage_index.to_string())];
            metrics::counter!("baton_worker_state_snapshots_saved_total", &label).increment(1);
        }
        Ok(())
    }

    /// Undo a verify chunk's rejected proposals on a stage with recurrent state: put back the
    /// state from before the chunk and run its kept rows (up to `chunk`'s start) again.
    fn replay(&mut self, chunk: &SequenceChunk, slot: usize, rollback: Option<Box<Rollback>>) -> Result<(), String> {
        let Some(mut rb) = rollback.filter(|rb| rb.armed) else {
            return Err("proposals to drop, but no state from before them was kept".into());
        };
        let h = self.backend.shape().config.hidden_size;
        let keep = chunk.pos0 as usize - rb.pos0;
        if keep == 0 || keep * h > rb.hidden.len() {
            return Err(format!(
                "a chunk at {} cannot follow the verify chunk at {} of {} rows",
                chunk.pos0,
                rb.pos0,
                rb.hidden.len() / h.max(1)
            ));
        }
        let mut rows = std::mem::take(&mut self.replay_rows);
        rows.clear();
        rows.extend_from_slice(&rb.hidden[..keep * h]);
        let again = SeqChunk {
            pos0: rb.pos0,
            len: keep,
            stored: rb.pos0,
            table: &chunk.blocks,
            state_slot: slot,
            prompt_len: 0,
        };
        let ran = self
            .backend
            .restore_state(slot, &rb.state)
            .and_then(|()| self.backend.forward(&mut rows, &[again]));
        self.replay_rows = rows;
        rb.armed = false;
        if let Some(seq) = self.seqs.get_mut(&chunk.seq_id) {
            seq.rollback = Some(rb);
        }
        let label = [("stage", self.stage_index.to_string())];
        metrics::counter!("baton_spec_state_replays_total", &label).increment(1);
        metrics::counter!("baton_spec_replayed_tokens_total", &label).increment(keep as u64);
        ran.map_err(|e| format!("rolling back the recurrent state: {e}"))
    }

    /// Before a micro-batch runs on a stage with recurrent state: for each chunk that carries
    /// proposals, keep its sequence's state and the chunk's input rows (see [`Rollback`]).
    fn keep_rollbacks(&mut self, seqs: &[SequenceChunk], hidden: &[f32]) -> Result<(), String> {
        let h = self.backend.shape().config.hidden_size;
        let mut offset = 0;
        for chunk in seqs {
            let n = chunk.tokens.len();
            let rows = &hidden[offset * h..(offset + n) * h];
            offset += n;
            let Some(seq) = self.seqs.get_mut(&chunk.seq_id) else {
                continue;
            };
            if chunk.draft == 0 {
                if let Some(rb) = seq.rollback.as_mut() {
                    rb.armed = false;
                }
                continue;
            }
            let rb = seq.rollback.get_or_insert_with(Box::default);
            rb.pos0 = chunk.pos0 as usize;
            rb.hidden.clear();
            rb.hidden.extend_from_slice(rows);
            self.backend
                .save_state(seq.state_slot, &mut rb.state)
                .map_err(|e| format!("sequence {}: keeping its recurrent state: {e}", chunk.seq_id))?;
            rb.armed = true;
        }
        Ok(())
    }

    /// Sample the next token of every chunk that asks for one, with one head product over all
    /// their last rows, on the backend's device. Each sequence's sampler goes to the backend
    /// and comes back advanced.
    fn sample(&mut self, batch: &MicroBatch, hidden: &[f32]) -> Result<BatchResult, String> {
        let h = self.backend.shape().config.hidden_size;
        let rows = &mut self.sample_rows;
        rows.clear();
        self.slots.clear();
        let mut missing = None;
        let mut offset = 0;
        for chunk in &batch.seqs {
            offset += chunk.tokens.len();
            if !chunk.sample {
                continue;
            }
            let Some(seq) = self.seqs.get_mut(&chunk.seq_id) else {
                missing = Some(format!("sequence {} vanished", chunk.seq_id));
                break;
            };
            let Some(sampler) = seq.sampler.take() else {
                missing = Some(format!("sequence {} has no sampler", chunk.seq_id));
                break;
            };
            // The last row, or with a draft the rows of its last token and every proposal.
            let draft = chunk.draft as usize;
            rows.extend_from_slice(&hidden[(offset - 1 - draft) * h..offset * h]);
            let mut slot = SampleSlot::new(sampler, seq.logprobs.then_some(seq.top_logprobs));
            slot.draft
                .extend_from_slice(&chunk.tokens[chunk.tokens.len() - draft..]);
            self.slots.push(slot);
        }
        let mut results = Vec::with_capacity(self.slots.len());
        let sampled = match missing {
            Some(e) => Err(e),
            None if self.slots.is_empty() => Ok(()),
            None => self
                .backend
                .sample(&self.sample_rows, &mut self.slots)
                .map_err(|e| e.to_string()),
        };
        // Samplers go back whatever happened, so a failed batch leaves every sequence whole.
        let picked = batch.seqs.iter().filter(|c| c.sample);
        for (chunk, slot) in picked.zip(self.slots.drain(..)) {
            let SampleSlot {
                sampler,
                top_logprobs,
                token,
                logprob,
                top,
                more,
                more_logprobs,
                ..
            } = slot;
            if let Some(seq) = self.seqs.get_mut(&chunk.seq_id) {
                seq.sampler = Some(sampler);
            }
            let mut r = SequenceResult {
                seq_id: chunk.seq_id,
                token,
                more_tokens: more,
                ..Default::default()
            };
            if top_logprobs.is_some() {
                r.logprob = logprob;
                (r.top_ids, r.top_logprobs) = top.into_iter().unzip();
                r.more_logprobs = more_logprobs
                    .into_iter()
                    .map(|(logprob, top)| {
                        let (top_ids, top_logprobs) = top.into_iter().unzip();
                        TokenLogprobs {
                            logprob,
                            top_ids,
                            top_logprobs,
                        }
                    })
                    .collect();
            }
            results.push(r);
        }
        sampled.map_err(|e| self.err(e))?;
        Ok(BatchResult {
            batch_id: batch.batch_id,
            results,
            error: String::new(),
        })
    }
}
