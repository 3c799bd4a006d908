//! The building blocks architectures are made of, each written once against [`Ops`]: RMSNorm,
//! grouped-query self-attention, the gated MLP, and the pre-norm decoder layer that strings
//! them together. A block loads its weights from the tensor specs an architecture module
//! gives it, through [`WeightLoader`], so a device can upload or repack them.

mod attention;
mod mlp;
mod norm;

pub use attention::Attention;
pub use mlp::GatedMlp;
pub use norm::RmsNorm;

use baton_shared::model_files::LoadError;

use super::arch::{FfnTensors, LayerPlan, MixerTensors};
use super::loader::WeightLoader;
use super::scratch::{Batch, Scratch};
use crate::ops::Ops;

/// What mixes positions in a layer.
pub enum Mixer<O: Ops> {
    Attention(Attention<O>),
}

/// The feed-forward part of a layer.
pub enum Ffn<O: Ops> {
    Dense(GatedMlp<O>),
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
        Ok(Self {
            mixer_norm: RmsNorm::load(w, &plan.mixer_norm)?,
            mixer: match &plan.mixer {
                MixerTensors::Attention(a) => Mixer::Attention(Attention::load(w, a)?),
            },
            ffn_norm: RmsNorm::load(w, &plan.ffn_norm)?,
            ffn: match &plan.ffn {
                FfnTensors::Dense(m) => Ffn::Dense(GatedMlp::load(w, m)?),
            },
        })
    }

    /// Run the layer on `s.hidden`; `index` is the layer's position within the stage (its
    /// slot in the stage's K/V store).
    pub fn forward(&self, ops: &O, index: usize, kv: &mut O::Kv<'_>, batch: &Batch, s: &mut Scratch<O>) {
        self.mixer_norm.apply(ops, &s.hidden, &mut s.xn);
        match &self.mixer {
            Mixer::Attention(a) => a.forward(ops, index, kv, batch, s),
        }
        ops.add(&mut s.hidden, &s.proj);
        self.ffn_norm.apply(ops, &s.hidden, &mut s.xn);
        match &self.ffn {
            Ffn::Dense(m) => m.forward(ops, s),
        }
        ops.add(&mut s.hidden, &s.proj);
    }

    /// The weight matrices (what the weight format applies to), in a fixed order.
    pub fn matrices(&self) -> Vec<&O::Mat> {
        let mut out = Vec::new();
        match &self.mixer {
            Mixer::Attention(a) => out.extend(a.matrices()),
        }
        match &self.ffn {
            Ffn::Dense(m) => out.extend(m.matrices()),
        }
        out
    }

    /// Values in the layer's vectors (norms, biases).
    pub fn vector_values(&self, ops: &O) -> usize {
        let mut n = self.mixer_norm.len(ops) + self.ffn_norm.len(ops);
        match &self.mixer {
            Mixer::Attention(a) => n += a.vector_values(ops),
        }
        n
    }
}
