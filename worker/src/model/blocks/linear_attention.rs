//! Gated DeltaNet (Qwen3-Next's and Qwen3.5's linear attention): projections of the input
//! into queries, keys, values, an output gate `z` and the per-head `b`/`a` gates (two fused
//! matrices in Qwen3-Next, four in Qwen3.5); a causal
//! depthwise conv1d with SiLU over q, k and v; L2-normed q and k; the gated delta rule, whose
//! state (one `[key_head_dim, value_head_dim]` matrix per value head) replaces a K/V cache;
//! then a per-head RMSNorm gated by `silu(z)` and the output projection.
//!
//! The conv's last inputs and the delta rule's matrices are the sequence's recurrent state,
//! carried from chunk to chunk by the cache [`Ops::linear_attention`] is given.

use baton_shared::model_files::LoadError;

use super::super::arch::{LinearAttentionTensors, LinearProjections};
use super::super::loader::WeightLoader;
use super::super::scratch::Scratch;
use super::RmsNorm;
use crate::ops::{LinearAttnShape, Ops};

/// The input projections on the device.
enum Projections<O: Ops> {
    Fused {
        qkvz: O::Mat,
        ba: O::Mat,
    },
    Split {
        qkv: O::Mat,
        z: O::Mat,
        b: O::Mat,
        a: O::Mat,
    },
}

/// A Gated DeltaNet block.
pub struct GatedDeltaNet<O: Ops> {
    shape: LinearAttnShape,
    projections: Projections<O>,
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
        let (channels, kernel) = (t.shape.channels(), t.shape.conv_kernel);
        let conv = w.host_vector(&t.conv)?;
        let mut conv_t = vec![0f32; conv.len()];
        for c in 0..channels {
            for j in 0..kernel {
                conv_t[j * channels + c] = conv[c * kernel + j];
            }
        }
        let mut a = w.host_vector(&t.a_log)?;
        // llama.cpp's converter stores the rate itself (`ssm_a`), Hugging Face its log.
        if !w.files.is_gguf() {
            a.iter_mut().for_each(|x| *x = -x.exp());
        }
        Ok(Self {
            shape: t.shape,
            projections: match &t.projections {
                LinearProjections::Fused { qkvz, ba } => Projections::Fused {
                    qkvz: w.matrix(qkvz)?,
                    ba: w.matrix(ba)?,
                },
                LinearProjections::Split { qkv, z, b, a } => Projections::Split {
                    qkv: w.matrix(qkv)?,
                    z: w.matrix(z)?,
                    b: w.matrix(b)?,
                    a: w.matrix(a)?,
                },
            },
            conv_t: w.ops.vector(conv_t),
            dt_bias: w.vector(&t.dt_bias)?,
            a: w.ops.vector(a),
            norm: RmsNorm::load(w, &t.norm)?,
            out: w.matrix(&t.out)?,
        })
    }

    /// `s.proj = deltanet(s.xn)`, carrying each sequence's state in slot `index` of `kv`.
    /// The conv input (every q, k, v) goes to `s.v`, `z` to `s.gate`, `b` and `a` to `s.up`
    /// and `s.expert_in`.
    pub fn forward(&self, ops: &O, index: usize, kv: &mut O::Kv<'_>, s: &mut Scratch<O>) {
        match &self.projections {
            Projections::Fused { qkvz, ba } => {
                ops.matmul_many(&mut s.ws, &s.xn, [(qkvz, None, &mut s.q), (ba, None, &mut s.k)]);
                ops.split_qkvz(
                    &s.q,
                    &s.k,
                    self.shape,
                    &mut s.v,
                    &mut s.gate,
                    &mut s.up,
                    &mut s.expert_in,
                );
            }
            Projections::Split { qkv, z, b, a } => ops.matmul_many(
                &mut s.ws,
                &s.xn,
                [
                    (qkv, None, &mut s.v),
                    (z, None, &mut s.gate),
                    (b, None, &mut s.up),
                    (a, None, &mut s.expert_in),
                ],
            ),
        }
        ops.linear_attention(
            &mut s.ws,
            index,
            &s.v,
            &s.up,
            &s.expert_in,
            [&self.conv_t, &self.dt_bias, &self.a],
            self.shape,
            kv,
            &mut s.attn,
        );
        let (w, eps) = self.norm.parts();
        ops.rmsnorm_gated(&mut s.attn, w, eps, &s.gate);
        ops.matmul(&mut s.ws, &s.attn, &self.out, None, &mut s.proj);
    }

    /// The input projections and the output projection.
    pub fn matrices(&self) -> Vec<&O::Mat> {
        let mut out = match &self.projections {
            Projections::Fused { qkvz, ba } => vec![qkvz, ba],
            Projections::Split { qkv, z, b, a } => vec![qkv, z, b, a],
        };
        out.push(&self.out);
        out
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
