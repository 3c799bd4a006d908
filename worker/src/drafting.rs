//! The last stage's DFlash draft: each sequence's draft context (per draft layer, the K/V of
//! the taps of its kept positions) and the proposals drafted after each verify step.
//!
//! The draft runs right after the verify step on the same stage, so the proposals for a
//! sequence's next step travel back with this step's tokens: drafting costs no extra round
//! trip through the pipeline.

use std::collections::HashMap;
use std::path::Path;

use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::ModelFiles;

use crate::backend::{Backend, BackendError};
use crate::kernels::cpu::dispatch::Kernels;
use crate::kv_cache::{AnyKv, BatchSeq, SequenceKv};
use crate::model::dflash::{DflashError, DflashFiles, DraftModel};
use crate::model::{ForwardError, Scratch};
use crate::ops::Ops;
use crate::ops::cpu::CpuOps;

/// Serve the DFlash draft at `path` on a stage: `fc`'s blocks for the stage's tap layers go
/// into `backend`, and a last stage also loads the draft itself (returned), on `threads` CPU
/// threads.
pub fn attach(
    backend: &mut dyn Backend,
    path: &Path,
    target_files: &ModelFiles,
    threads: usize,
    kernels: Option<Kernels>,
) -> Result<Option<DraftRunner>, BackendError> {
    let shape = backend.shape().clone();
    let draft = DflashFiles::open(path, &shape.config)?;
    let taps = backend.load_taps(&draft)?;
    tracing::info!(path = %path.display(), tap_layers = ?taps, last = shape.last, "DFlash draft attached");
    match shape.last {
        true => Ok(Some(DraftRunner::load(
            &draft,
            target_files,
            &shape.config,
            threads,
            kernels,
        )?)),
        false => Ok(None),
    }
}

/// One sequence's draft cache: cache row `r` holds absolute position `origin + r`.
struct DraftSeq {
    kv: SequenceKv,
    origin: usize,
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy)]
pub struct DraftWork<'a> {
    pub seq_id: u64,
    /// Absolute position of the first context row.
    pub start: usize,
    /// Context rows kept this step (the summed `fc` projections of their taps), `hidden` each.
    pub context: &'a [f32],
    /// The sequence's last token and how many proposals to draft after it (0: context only).
    pub anchor: u32,
    pub propose: usize,
}

/// The DFlash draft on the last stage, with every sequence's context.
pub struct DraftRunner {
    model: DraftModel<CpuOps>,
    scratch: Scratch<CpuOps>,
    seqs: HashMap<u64, DraftSeq>,
    /// Host rows reused across steps.
    rows: Vec<f32>,
    ids: Vec<u32>,
}

impl std::fmt::Debug for DraftRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftRunner")
            .field("block_size", &self.model.config.block_size)
            .field("sequences", &self.seqs.len())
            .finish_non_exhaustive()
    }
}

impl DraftRunner {
    /// Load the draft on `threads` CPU threads, embedding blocks from the target's table.
    pub fn load(
        draft: &DflashFiles,
        target_files: &ModelFiles,
        target: &ModelConfig,
        threads: usize,
        kernels: Option<Kernels>,
    ) -> Result<Self, DflashError> {
        let ops = CpuOps::new(threads.max(1), kernels);
        Ok(Self {
            model: DraftModel::load(ops, draft, target_files, target)?,
            scratch: Scratch::default(),
            seqs: HashMap::new(),
            rows: Vec::new(),
            ids: Vec::new(),
        })
    }

    /// Drop the context of sequences that ended or restart.
    pub fn forget(&mut self, ids: &[u64]) {
        for id in ids {
            self.seqs.remove(id);
        }
    }

    /// Bytes the draft contexts hold.
    pub fn context_bytes(&self) -> usize {
        self.seqs.values().map(|s| s.kv.bytes()).sum()
    }

    /// Add each sequence's kept context rows, then draft a block for each sequence that asks
    /// for proposals, with the target's head on `backend`; `out[i]` gets `work[i]`'s proposals.
    pub fn step(
        &mut self,
        work: &[DraftWork<'_>],
        backend: &mut dyn Backend,
        out: &mut Vec<Vec<u32>>,
    ) -> Result<(), ForwardError> {
        let h = self.model.config.layers.hidden_size;
        let (layers, kv_dim) = (self.model.num_layers(), self.model.kv_dim());
        out.clear();
        out.resize(work.len(), Vec::new());
        // Take each sequence's cache out of the map for the batch (put back whatever happens).
        let mut taken: Vec<DraftSeq> = Vec::with_capacity(work.len());
        for w in work {
            let seq = match self.seqs.remove(&w.seq_id) {
                Some(mut seq) if (seq.origin..=seq.origin + seq.kv.len()).contains(&w.start) => {
                    // Positions from `start` on were dropped and are being recomputed.
                    seq.kv.truncate(w.start - seq.origin);
                    seq
                }
                // New, restarted from a cached prefix (no taps for it) or after a gap: the
                // context starts here.
                _ => DraftSeq {
                    kv: SequenceKv::new(layers, kv_dim, 0),
                    origin: w.start,
                },
            };
            taken.push(seq);
        }
        let result = self.run(work, &mut taken, backend, h, out);
        for (w, seq) in work.iter().zip(taken) {
            self.seqs.insert(w.seq_id, seq);
        }
        result
    }

    fn run(
        &mut self,
        work: &[DraftWork<'_>],
        taken: &mut [DraftSeq],
        backend: &mut dyn Backend,
        h: usize,
        out: &mut [Vec<u32>],
    ) -> Result<(), ForwardError> {
        let s = &mut self.scratch;
        // Context rows of every sequence, one batch.
        self.rows.clear();
        let mut origin = Vec::with_capacity(work.len());
        let mut batch: Vec<BatchSeq<'_>> = Vec::with_capacity(work.len());
        for (w, seq) in work.iter().zip(taken.iter_mut()) {
            let n = w.context.len() / h;
            if n == 0 {
                continue;
            }
            self.rows.extend_from_slice(w.context);
            origin.push(seq.origin);
            batch.push(BatchSeq {
                pos0: w.start - seq.origin,
                len: n,
                prompt_len: 0,
                kv: &mut seq.kv,
            });
        }
        if !batch.is_empty() {
            self.model.ops.upload(&self.rows, &mut s.hidden);
            self.model.add_context(&mut AnyKv(&mut batch[..]), &origin, s)?;
        }
        drop(batch);
        // Then one block per sequence that asks for proposals.
        let b = self.model.config.block_size;
        let mut anchors = Vec::new();
        let mut origin = Vec::new();
        let mut kept = Vec::new();
        let mut batch: Vec<BatchSeq<'_>> = Vec::new();
        let mut asking = Vec::new();
        for (i, (w, seq)) in work.iter().zip(taken.iter_mut()).enumerate() {
            if w.propose == 0 || seq.kv.is_empty() {
                continue;
            }
            anchors.push(w.anchor);
            origin.push(seq.origin);
            kept.push(seq.kv.len());
            asking.push(i);
            let pos0 = seq.kv.len();
            batch.push(BatchSeq {
                pos0,
                len: b,
                prompt_len: 0,
                kv: &mut seq.kv,
            });
        }
        if batch.is_empty() {
            return Ok(());
        }
        self.model.embed_blocks(&anchors, s)?;
        let ran = self.model.run_blocks(&mut AnyKv(&mut batch[..]), &origin, s);
        // The block's K/V never stays: only kept positions are context.
        for (q, &len) in batch.iter_mut().zip(&kept) {
            q.kv.truncate(len);
        }
        ran?;
        // Rows 1.. of each block propose the tokens after the anchor.
        self.rows.clear();
        for i in 0..asking.len() {
            self.rows.extend_from_slice(&s.xn[(i * b + 1) * h..(i + 1) * b * h]);
        }
        backend.draft_argmax(&self.rows, &mut self.ids)?;
        for (j, &i) in asking.iter().enumerate() {
            let take = work[i].propose.min(b - 1);
            out[i].extend_from_slice(&self.ids[j * (b - 1)..j * (b - 1) + take]);
        }
        Ok(())
    }
}
