//! Gated DeltaNet (Qwen3-Next's linear attention): fused projections of the input into
//! queries, keys, values, an output gate `z` and the per-head `b`/`a` gates; a causal
//! depthwise conv1d with SiLU over q, k and v; L2-normed q and k; the gated delta rule, whose
//! state (one `[key_head_dim, value_head_dim]` matrix per value head) replaces a K/V cache;
//! then a per-head RMSNorm gated by `silu(z)` and the output projection.
//!
//! The conv's last inputs and the delta rule's matrices are the sequence's recurrent state,
//! carried from chunk to chunk by the cache [`Ops::linear_attention`] is given.

use baton_shared::model_files::LoadError;

use super::super::arch::LinearAttentionTensors;
use super::super::loader::WeightLoader;
use super::super::scratch::Scratch;
use super::RmsNorm;
use crate::ops::{LinearAttnShape, Ops};

/// A Gated DeltaNet block.
pub struct GatedDeltaNet<O: Ops> {
    shape: LinearAttnShape,
    in_qkvz: O::Mat,
    in_ba: O::Mat,
    /// The conv1d's taps as `[kernel, channels]` (each tap one contiguous row).
    conv_t: O::Vector,
    dt_bias: O::Vector,
    /// `-exp(A_log)`: each value head's (negative) decay rate.
    a: O::Vector,
    norm: RmsNorm<O>,
    out: O::Mat,
}

impl<O: Ops> GatedDeltaNet<O> {
    /// Load the tensors `t` names.
    pub fn load(w: &WeightLoader<'_, O>, t: &LinearAttentionTensors) -> Result<Self, LoadError> {
        let channels = t.conv_channels();
        let kernel = t.conv_kernel;
        let conv = w.host_vector(&t.conv)?;
        let mut conv_t = vec![0f32; conv.len()];
        for c in 0..channels {
            for j in 0..kernel {
                conv_t[j * channels + c] = conv[c * kernel + j];
            }
        }
        let a: Vec<f32> = w.host_vector(&t.a_log)?.iter().map(|x| -x.exp()).collect();
        Ok(Self {
            shape: LinearAttnShape {
                key_heads: t.key_heads,
                value_heads: t.value_heads,
                key_head_dim: t.key_head_dim,
                value_head_dim: t.value_head_dim,
                conv_kernel: kernel,
            },
            in_qkvz: w.matrix(&t.in_qkvz)?,
            in_ba: w.matrix(&t.in_ba)?,
            conv_t: w.ops.vector(conv_t),
            dt_bias: w.vector(&t.dt_bias)?,
            a: w.ops.vector(a),
            norm: RmsNorm::load(w, &t.norm)?,
            out: w.matrix(&t.out)?,
        })
    }

    /// `s.proj = deltanet(s.xn)`, carrying each sequence's state in slot `index` of `kv`.
    pub fn forward(&self, ops: &O, index: usize, kv: &mut O::Kv<'_>, s: &mut Scratch<O>) {
        ops.matmul_many(
            &mut s.ws,
            &s.xn,
            [(&self.in_qkvz, None, &mut s.q), (&self.in_ba, None, &mut s.k)],
        );
        ops.linear_attention(
            &mut s.ws,
            index,
            &s.q,
            &s.k,
            [&self.conv_t, &self.dt_bias, &self.a],
            self.shape,
            kv,
            &mut s.attn,
            &mut s.gate,
        );
        let (w, eps) = self.norm.parts();
        ops.rmsnorm_gated(&mut s.attn, w, eps, &s.gate);
        ops.matmul(&mut s.ws, &s.attn, &self.out, None, &mut s.proj);
    }

    /// The input projections and the output projection.
    pub fn matrices(&self) -> [&O::Mat; 3] {
        [&self.in_qkvz, &self.in_ba, &self.out]
    }

    /// Values in the conv taps, gates' biases and rates, and the norm.
    pub fn vector_values(&self, ops: &O) -> usize {
        [&self.conv_t, &self.dt_bias, &self.a]
            .iter()
            .map(|v| ops.vector_len(v))
            .sum::<usize>()
            + self.norm.len(ops)
    }
}
