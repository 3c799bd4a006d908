//! The building blocks architectures are made of, each written once against [`Ops`]: RMSNorm,
//! grouped-query self-attention, Gated DeltaNet linear attention, the gated MLP, a routed
//! mixture of such MLPs, and the pre-norm decoder layer that strings them together. A block loads its weights from the tensor specs an architecture module
//! gives it, through [`WeightLoader`], so a device can upload or repack them.

mod attention;
mod linear_attention;
mod mlp;
mod moe;
mod norm;

pub use attention::Attention;
pub use linear_attention::GatedDeltaNet;
pub use mlp::GatedMlp;
pub use moe::SparseMoe;
pub use norm::RmsNorm;

use baton_shared::model_files::LoadError;

use super::arch::{FfnTensors, LayerPlan, MixerTensors};
use super::loader::WeightLoader;
use super::scratch::{Batch, Scratch};
use crate::ops::{AttnMask, Ops};

/// What mixes positions in a layer.
pub enum Mixer<O: Ops> {
    Attention(Attention<O>),
    LinearAttention(GatedDeltaNet<O>),
}

/// The feed-forward part of a layer.
pub enum Ffn<O: Ops> {
    Dense(GatedMlp<O>),
    Moe(SparseMoe<O>),
}

/// One pre-norm decoder layer: `x += mixer(norm(x)); x += ffn(norm(x))`.
pub struct DecoderLayer<O: Ops> {
    pub mixer_norm: RmsNorm<O>,
    pub mixer: Mixer<O>,
    pub ffn_norm: RmsNorm<O>,
    pub ffn: Ffn<O>,
}

impl<O: Ops> DecoderLayer<O> {
    /// Load the layer `plan` describes.
    pub fn load(w: &WeightLoader<'_, O>, plan: &LayerPlan) -> Result<Self, LoadError> {
        let scale = plan.norm_scale;
        Ok(Self {
            mixer_norm: RmsNorm::load_scaled(w, &plan.mixer_norm, scale)?,
            mixer: match &plan.mixer {
                MixerTensors::Attention(a) => Mixer::Attention(Attention::load(w, a, scale)?),
                MixerTensors::LinearAttention(a) => Mixer::LinearAttention(GatedDeltaNet::load(w, a)?),
            },
            ffn_norm: RmsNorm::load_scaled(w, &plan.ffn_norm, scale)?,
            ffn: match &plan.ffn {
                FfnTensors::Dense(m) => Ffn::Dense(GatedMlp::load(w, m)?),
                FfnTensors::Moe(m) => Ffn::Moe(SparseMoe::load(w, m)?),
            },
        })
    }

    /// Run the layer on `s.hidden`; `index` is the layer's slot in the stage's cache of its
    /// kind (K/V for attention, recurrent state for linear attention).
    pub fn forward(&self, ops: &O, index: usize, kv: &mut O::Kv<'_>, batch: &Batch, s: &mut Scratch<O>) {
        self.forward_masked(ops, index, kv, batch, AttnMask::Causal, s);
    }

    /// [`forward`](Self::forward) with the attention seeing what `mask` says.
    pub fn forward_masked(
        &self,
        ops: &O,
        index: usize,
        kv: &mut O::Kv<'_>,
        batch: &Batch,
        mask: AttnMask,
        s: &mut Scratch<O>,
    ) {
        // Both norms feed products: a device may quantize their rows for them in the same pass.
        self.mixer_norm.apply_for_product(ops, &mut s.ws, &s.hidden, &mut s.xn);
        match &self.mixer {
            Mixer::Attention(a) => a.forward(ops, index, kv, batch, mask, s),
            Mixer::LinearAttention(d) => d.forward(ops, index, kv, s),
        }
        self.ffn_norm
            .add_apply_for_product(ops, &mut s.ws, &mut s.hidden, &s.proj, &mut s.xn);
        match &self.ffn {
            Ffn::Dense(m) => m.forward(ops, s),
            Ffn::Moe(m) => m.forward(ops, s),
        }
        ops.add(&mut s.hidden, &s.proj);
    }

    /// The weight matrices (what the weight format applies to), in a fixed order.
    pub fn matrices(&self) -> Vec<&O::Mat> {
        let mut out = Vec::new();
        match &self.mixer {
            Mixer::Attention(a) => out.extend(a.matrices()),
            Mixer::LinearAttention(d) => out.extend(d.matrices()),
        }
        match &self.ffn {
            Ffn::Dense(m) => out.extend(m.matrices()),
            Ffn::Moe(m) => {
                out.extend(m.matrices());
                out.extend(m.shared_matrices());
            }
        }
        out
    }

    /// Bytes of all the layer's weights on the device.
    pub fn weight_bytes(&self, ops: &O) -> usize {
        let matrices: usize = self.matrices().iter().map(|m| ops.matrix_bytes(m)).sum();
        matrices + self.router_bytes(ops) + 4 * self.vector_values(ops)
    }

    /// Bytes of matrix weights one position reads: every matrix, but of a mixture of experts
    /// only the router and `top_k` experts' worth.
    pub fn decode_bytes(&self, ops: &O) -> usize {
        let all: usize = self.matrices().iter().map(|m| ops.matrix_bytes(m)).sum();
        match &self.ffn {
            Ffn::Dense(_) => all,
            Ffn::Moe(m) => {
                let experts: usize = m.matrices().map(|w| ops.matrix_bytes(w)).sum();
                all - experts + experts / m.experts() * m.top_k() + self.router_bytes(ops)
            }
        }
    }

    fn router_bytes(&self, ops: &O) -> usize {
        match &self.ffn {
            Ffn::Dense(_) => 0,
            Ffn::Moe(m) => ops.matrix_bytes(m.router()) + m.shared_gate().map_or(0, |g| ops.matrix_bytes(g)),
        }
    }

    /// Values in the layer's vectors (norms, biases).
    pub fn vector_values(&self, ops: &O) -> usize {
        let mut n = self.mixer_norm.len(ops) + self.ffn_norm.len(ops);
        match &self.mixer {
            Mixer::Attention(a) => n += a.vector_values(ops),
            Mixer::LinearAttention(d) => n += d.vector_values(ops),
        }
        n
    }
}
