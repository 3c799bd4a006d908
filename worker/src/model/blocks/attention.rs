//! Grouped-query causal self-attention with rotary positions, optional q/k/v biases (Qwen2),
//! optional per-head q/k RMSNorm (Qwen3), and Qwen3-Next's output gate and partial rotation.

use baton_shared::model_files::LoadError;

use super::super::arch::{AttentionTensors, NormScale};
use super::super::loader::WeightLoader;
use super::super::scratch::{Batch, Scratch};
use super::RmsNorm;
use crate::ops::{AttnMask, AttnShape, Ops};

/// A self-attention block.
pub struct Attention<O: Ops> {
    shape: AttnShape,
    q: O::Mat,
    k: O::Mat,
    v: O::Mat,
    o: O::Mat,
    bias: Option<[O::Vector; 3]>,
    qk_norm: Option<[RmsNorm<O>; 2]>,
    rotary_dim: usize,
    output_gate: bool,
}

impl<O: Ops> Attention<O> {
    /// Load the tensors `t` names, the q/k norms' vectors stored as `norm` says.
    pub fn load(w: &WeightLoader<'_, O>, t: &AttentionTensors, norm: NormScale) -> Result<Self, LoadError> {
        let bias = match &t.qkv_bias {
            Some([q, k, v]) => Some([w.vector(q)?, w.vector(k)?, w.vector(v)?]),
            None => None,
        };
        let qk_norm = match &t.qk_norm {
            Some([q, k]) => Some([RmsNorm::load_scaled(w, q, norm)?, RmsNorm::load_scaled(w, k, norm)?]),
            None => None,
        };
        Ok(Self {
            shape: AttnShape {
                num_heads: t.heads,
                num_kv_heads: t.kv_heads,
                head_dim: t.head_dim,
            },
            q: w.matrix(&t.q)?,
            k: w.matrix(&t.k)?,
            v: w.matrix(&t.v)?,
            o: w.matrix(&t.o)?,
            bias,
            qk_norm,
            rotary_dim: t.rotary_dim,
            output_gate: t.output_gate,
        })
    }

    /// `s.proj = attention(s.xn)`, storing this layer's new K/V in slot `index` of `kv`; each
    /// row sees the positions `mask` says.
    pub fn forward(
        &self,
        ops: &O,
        index: usize,
        kv: &mut O::Kv<'_>,
        batch: &Batch,
        mask: AttnMask,
        s: &mut Scratch<O>,
    ) {
        let [bq, bk, bv] = self.biases();
        // With an output gate, q's product holds each head's queries and then its gates.
        let q_out = match self.output_gate {
            true => &mut s.gate,
            false => &mut s.q,
        };
        ops.matmul_many(
            &mut s.ws,
            &s.xn,
            [(&self.q, bq, q_out), (&self.k, bk, &mut s.k), (&self.v, bv, &mut s.v)],
        );
        let (hd, sh, rd) = (self.shape.head_dim, self.shape, self.rotary_dim);
        if self.output_gate {
            ops.deinterleave(&s.gate, hd, &mut s.q, &mut s.up);
        }
        if let Some([qn, kn]) = &self.qk_norm {
            qn.apply_inplace(ops, &mut s.q);
            kn.apply_inplace(ops, &mut s.k);
        }
        let widths = (sh.num_heads * hd, sh.num_kv_heads * hd);
        ops.rope_qk(&mut s.q, &mut s.k, widths, hd, rd, &batch.cos, &batch.sin);
        ops.attention(
            &mut s.ws,
            index,
            &s.q,
            &s.k,
            &s.v,
            kv,
            sh,
            mask,
            batch.longest,
            &mut s.attn,
        );
        if self.output_gate {
            ops.sigmoid_mul(&mut s.attn, &s.up);
        }
        ops.matmul(&mut s.ws, &s.attn, &self.o, None, &mut s.proj);
    }

    /// Keys and values of the rows in `s.xn` (normed, rotated at `batch`'s positions) stored in
    /// slot `index` of `kv`, with no queries: a DFlash draft's context rows, which every later
    /// block attends to.
    pub fn store_context(&self, ops: &O, index: usize, kv: &mut O::Kv<'_>, batch: &Batch, s: &mut Scratch<O>) {
        let [_, bk, bv] = self.biases();
        ops.matmul_many(&mut s.ws, &s.xn, [(&self.k, bk, &mut s.k), (&self.v, bv, &mut s.v)]);
        if let Some([_, kn]) = &self.qk_norm {
            kn.apply_inplace(ops, &mut s.k);
        }
        let hd = self.shape.head_dim;
        ops.rope(
            &mut s.k,
            self.shape.num_kv_heads * hd,
            hd,
            self.rotary_dim,
            &batch.cos,
            &batch.sin,
        );
        ops.store_kv(index, &s.k, &s.v, kv);
    }

    /// The q, k and v biases, each None without them.
    fn biases(&self) -> [Option<&O::Vector>; 3] {
        match &self.bias {
            Some([q, k, v]) => [Some(q), Some(k), Some(v)],
            None => [None; 3],
        }
    }

    /// q, k, v, o.
    pub fn matrices(&self) -> [&O::Mat; 4] {
        [&self.q, &self.k, &self.v, &self.o]
    }

    /// Values in the biases and q/k norms.
    pub fn vector_values(&self, ops: &O) -> usize {
        let bias: usize = self.bias.iter().flatten().map(|b| ops.vector_len(b)).sum();
        bias + self.qk_norm.iter().flatten().map(|n| n.len(ops)).sum::<usize>()
    }
}
