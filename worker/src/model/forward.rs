//! The forward pass over a stage's layer range: "run layers [a, b) on these hidden states".
//! Matrix products go through the dispatched kernels on the stage's pool; everything else is the
//! fp32 reference kernels.

use crate::kernels::cpu::attention::{SeqAttn, attention_batch};
use crate::kernels::cpu::elementwise as ew;
use crate::kernels::cpu::matmul::{MatRef, Product, matmul, matmul_many};
use crate::kernels::cpu::q8::QuantizedRows;
use crate::kernels::cpu::reference::AttnShape;
use crate::kv_cache::{BatchKv, BatchSeq, SequenceKv};
use crate::threads::SharedMut;

use super::weights::StageWeights;

/// Errors from a forward pass (bad input, never a panic).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ForwardError {
    #[error("token id {id} is out of range (vocabulary has {vocab} entries)")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("empty input: at least one token is needed")]
    Empty,
    #[error("sequence of {needed} tokens exceeds the model context of {max}")]
    ContextOverflow { needed: usize, max: usize },
    #[error("this stage does not hold the {0}")]
    MissingPart(&'static str),
    #[error("hidden states have {got} values, expected a multiple of {hidden}")]
    HiddenShape { got: usize, hidden: usize },
    #[error("KV cache holds {have} positions but the batch starts at position {pos0}")]
    KvPosition { have: usize, pos0: usize },
    #[error("{positions} positions need {needed} KV blocks but the block table has {have}")]
    KvBlocks {
        positions: usize,
        needed: usize,
        have: usize,
    },
    #[error("KV block id {id} is outside the pool of {blocks} blocks")]
    KvBlockId { id: u32, blocks: usize },
}

/// Reusable work buffers; they grow to the largest batch seen and are then reused, so steady
/// decoding allocates nothing.
#[derive(Debug, Default)]
pub struct Scratch {
    xn: Vec<f32>,
    q: Vec<f32>,
    kk: Vec<f32>,
    vv: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Attention scores, one buffer per (sequence, head) task.
    scores: Vec<f32>,
    /// First row of each sequence of a batch.
    offsets: Vec<usize>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// Activations quantized for Q8_0 weights.
    xq: QuantizedRows,
}

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

impl StageWeights {
    /// `out = x · wᵀ (+ bias)` on this stage's kernels and pool.
    fn mm(&self, x: &[f32], w: MatRef<'_>, bias: Option<&[f32]>, out: &mut [f32], xq: &mut QuantizedRows) {
        matmul(self.kernels, &self.pool, x, w, bias, out, xq);
    }

    /// Several products of the same `x` in one pool job.
    fn mm_many<const N: usize>(&self, x: &[f32], products: [Product<'_, '_>; N], xq: &mut QuantizedRows) {
        matmul_many(self.kernels, &self.pool, x, products, xq);
    }

    /// `gate = silu(gate) · up` over `width`-wide rows, spread over the pool for many rows
    /// (element-wise, so the split never changes a result).
    fn silu_mul_rows(&self, gate: &mut [f32], up: &[f32], width: usize) {
        const ROWS: usize = 8;
        let rows = gate.len() / width;
        if rows < 2 * ROWS || self.pool.threads() == 1 {
            return ew::silu_mul(self.kernels, gate, up);
        }
        let shared = SharedMut::new(gate);
        self.pool.run(rows.div_ceil(ROWS), &|task| {
            let (v0, n) = (task * ROWS * width, ROWS.min(rows - task * ROWS) * width);
            // SAFETY: tasks cover disjoint row ranges.
            let g = unsafe { shared.slice(v0, n) };
            ew::silu_mul(self.kernels, g, &up[v0..v0 + n]);
        });
    }

    /// Embedding rows for `tokens` into `out` (`tokens.len() × hidden`).
    pub fn embed(&self, tokens: &[u32], out: &mut [f32]) -> Result<(), ForwardError> {
        let emb = self
            .embedding
            .as_deref()
            .filter(|_| self.is_first)
            .ok_or(ForwardError::MissingPart("embedding"))?;
        let h = self.config.hidden_size;
        let vocab = self.config.vocab_size;
        if tokens.is_empty() {
            return Err(ForwardError::Empty);
        }
        for (&id, row) in tokens.iter().zip(out.chunks_exact_mut(h)) {
            if id as usize >= vocab {
                return Err(ForwardError::TokenOutOfRange { id, vocab });
            }
            row.copy_from_slice(&emb[id as usize * h..(id as usize + 1) * h]);
        }
        Ok(())
    }

    /// Run this stage's layers on `hidden` (`t × hidden_size`, tokens at positions
    /// `pos0..pos0+t` of one sequence), updating the sequence's KV cache.
    pub fn forward(
        &self,
        hidden: &mut [f32],
        pos0: usize,
        kv: &mut SequenceKv,
        s: &mut Scratch,
    ) -> Result<(), ForwardError> {
        let h = self.config.hidden_size;
        let len = hidden.len() / h;
        self.forward_batch(hidden, &mut [BatchSeq { pos0, len, kv }][..], s)
    }

    /// Run this stage's layers on the tokens of several sequences at once: `hidden` holds
    /// every sequence's rows back to back, in `seqs` order. Each weight matrix is applied to
    /// all rows in one product (read from memory once per batch, not once per sequence);
    /// attention runs per sequence over its own cache. Each row's result is bit-identical to
    /// running its sequence alone.
    pub fn forward_batch<K: BatchKv + ?Sized>(
        &self,
        hidden: &mut [f32],
        kv: &mut K,
        s: &mut Scratch,
    ) -> Result<(), ForwardError> {
        let c = &self.config;
        let h = c.hidden_size;
        let n_seqs = kv.seqs();
        if hidden.is_empty() || n_seqs == 0 || (0..n_seqs).any(|i| kv.span(i).1 == 0) {
            return Err(ForwardError::Empty);
        }
        let t: usize = (0..n_seqs).map(|i| kv.span(i).1).sum();
        if hidden.len() != t * h {
            return Err(ForwardError::HiddenShape {
                got: hidden.len(),
                hidden: h,
            });
        }
        let mut longest = 0;
        for i in 0..n_seqs {
            let (pos0, len) = kv.span(i);
            if kv.stored(i) != pos0 {
                return Err(ForwardError::KvPosition {
                    have: kv.stored(i),
                    pos0,
                });
            }
            let end = pos0 + len;
            if end > c.max_position_embeddings {
                return Err(ForwardError::ContextOverflow {
                    needed: end,
                    max: c.max_position_embeddings,
                });
            }
            longest = longest.max(end);
        }
        kv.prepare()?;
        s.offsets.clear();
        let mut row = 0;
        for i in 0..n_seqs {
            s.offsets.push(row);
            row += kv.span(i).1;
        }
        let (qd, kvd, hd, f) = (c.q_dim(), c.kv_dim(), c.head_dim, c.intermediate_size);
        let half = hd / 2;
        let cos = grow(&mut s.cos, t * half);
        let sin = grow(&mut s.sin, t * half);
        let mut row = 0;
        for i in 0..n_seqs {
            let (pos0, len) = kv.span(i);
            for p in pos0..pos0 + len {
                let at = row * half..(row + 1) * half;
                self.rope.tables(p, &mut cos[at.clone()], &mut sin[at]);
                row += 1;
            }
        }
        let shape = AttnShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: hd,
        };
        for (l, lw) in self.layer_weights.iter().enumerate() {
            let xn = grow(&mut s.xn, t * h);
            ew::rmsnorm(self.kernels, hidden, &lw.attn_norm, c.rms_norm_eps, xn);
            let q = grow(&mut s.q, t * qd);
            let kk = grow(&mut s.kk, t * kvd);
            let vv = grow(&mut s.vv, t * kvd);
            self.mm_many(
                xn,
                [
                    (lw.wq.view(), lw.bq.as_deref(), &mut *q),
                    (lw.wk.view(), lw.bk.as_deref(), &mut *kk),
                    (lw.wv.view(), lw.bv.as_deref(), &mut *vv),
                ],
                &mut s.xq,
            );
            if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
                ew::rmsnorm_inplace(self.kernels, q, qn, c.rms_norm_eps);
                ew::rmsnorm_inplace(self.kernels, kk, kn, c.rms_norm_eps);
            }
            for i in 0..t {
                let (cr, sr) = (&s.cos[i * half..(i + 1) * half], &s.sin[i * half..(i + 1) * half]);
                ew::rope_rotate_half(self.kernels, &mut q[i * qd..(i + 1) * qd], hd, cr, sr);
                ew::rope_rotate_half(self.kernels, &mut kk[i * kvd..(i + 1) * kvd], hd, cr, sr);
            }
            let mut row = 0;
            for i in 0..n_seqs {
                let n = kv.span(i).1;
                kv.write(i, l, &kk[row * kvd..(row + n) * kvd], &vv[row * kvd..(row + n) * kvd]);
                row += n;
            }
            let attn = grow(&mut s.attn, t * qd);
            let (kvr, offsets) = (&*kv, &s.offsets);
            let seq = |i: usize| {
                let (pos0, rows) = kvr.span(i);
                let (k, v, layout) = kvr.layer(i, l);
                SeqAttn {
                    pos0,
                    rows,
                    offset: offsets[i],
                    k,
                    v,
                    layout,
                }
            };
            attention_batch(
                self.kernels,
                &self.pool,
                q,
                n_seqs,
                &seq,
                longest,
                shape,
                &mut s.scores,
                attn,
            );
            let proj = grow(&mut s.proj, t * h);
            self.mm(attn, lw.wo.view(), None, proj, &mut s.xq);
            hidden.iter_mut().zip(proj.iter()).for_each(|(x, p)| *x += p);

            let xn = grow(&mut s.xn, t * h);
            ew::rmsnorm(self.kernels, hidden, &lw.ffn_norm, c.rms_norm_eps, xn);
            let gate = grow(&mut s.gate, t * f);
            let up = grow(&mut s.up, t * f);
            self.mm_many(
                xn,
                [(lw.w_gate.view(), None, &mut *gate), (lw.w_up.view(), None, &mut *up)],
                &mut s.xq,
            );
            self.silu_mul_rows(gate, up, f);
            let proj = grow(&mut s.proj, t * h);
            self.mm(gate, lw.w_down.view(), None, proj, &mut s.xq);
            hidden.iter_mut().zip(proj.iter()).for_each(|(x, p)| *x += p);
        }
        kv.commit();
        Ok(())
    }

    /// Final norm and head on each row of `hidden`, writing `rows × vocab` logits to `out`.
    pub fn logits(&self, hidden: &[f32], s: &mut Scratch, out: &mut [f32]) -> Result<(), ForwardError> {
        let head = self.head().ok_or(ForwardError::MissingPart("head"))?;
        let norm = self
            .final_norm
            .as_deref()
            .ok_or(ForwardError::MissingPart("final norm"))?;
        let h = self.config.hidden_size;
        if hidden.is_empty() || !hidden.len().is_multiple_of(h) {
            return Err(ForwardError::HiddenShape {
                got: hidden.len(),
                hidden: h,
            });
        }
        let xn = grow(&mut s.xn, hidden.len());
        ew::rmsnorm(self.kernels, hidden, norm, self.config.rms_norm_eps, xn);
        self.mm(xn, head, None, out, &mut s.xq);
        Ok(())
    }
}
