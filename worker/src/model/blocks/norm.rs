//! RMSNorm with a learned scale.

use baton_shared::model_files::{LoadError, TensorSpec};

use super::super::arch::NormScale;
use super::super::loader::WeightLoader;
use crate::ops::Ops;

/// `x / rms(x) · weight` over each row.
pub struct RmsNorm<O: Ops> {
    weight: O::Vector,
    eps: f32,
}

impl<O: Ops> RmsNorm<O> {
    /// Load the scale `spec` names; epsilon from the config.
    pub fn load(w: &WeightLoader<'_, O>, spec: &TensorSpec) -> Result<Self, LoadError> {
        Self::load_scaled(w, spec, NormScale::Weight)
    }

    /// [`load`](Self::load) a vector stored as `scale` says (`1 + w` is formed here, in f32,
    /// as transformers forms it in every forward pass).
    pub fn load_scaled(w: &WeightLoader<'_, O>, spec: &TensorSpec, scale: NormScale) -> Result<Self, LoadError> {
        let weight = match scale {
            // A Hugging Face file stores the offset from one; llama.cpp's converter adds the
            // one before it writes a GGUF file.
            NormScale::OnePlusWeight if !w.files.is_gguf() => {
                let mut v = w.host_vector(spec)?;
                v.iter_mut().for_each(|x| *x += 1.0);
                w.ops.vector(v)
            }
            NormScale::OnePlusWeight | NormScale::Weight => w.vector(spec)?,
        };
        Ok(Self {
            weight,
            eps: w.config.rms_norm_eps,
        })
    }

    /// The scale and epsilon (for operations that fuse the norm with something else).
    pub fn parts(&self) -> (&O::Vector, f32) {
        (&self.weight, self.eps)
    }

    /// Normalize every row of `x` into `out`.
    pub fn apply(&self, ops: &O, x: &O::Buf, out: &mut O::Buf) {
        ops.rmsnorm(x, &self.weight, self.eps, out);
    }

    /// [`apply`](Self::apply) when the next call is a product over `out` with `ws`
    /// ([`Ops::rmsnorm_for_product`]).
    pub fn apply_for_product(&self, ops: &O, ws: &mut O::Workspace, x: &O::Buf, out: &mut O::Buf) {
        ops.rmsnorm_for_product(ws, x, &self.weight, self.eps, out);
    }

    /// `x += y`, then [`apply_for_product`](Self::apply_for_product): the residual add and
    /// the next norm ([`Ops::add_rmsnorm_for_product`]).
    pub fn add_apply_for_product(&self, ops: &O, ws: &mut O::Workspace, x: &mut O::Buf, y: &O::Buf, out: &mut O::Buf) {
        ops.add_rmsnorm_for_product(ws, x, y, &self.weight, self.eps, out);
    }

    /// Normalize each scale-wide piece of `x` in place (per-head q/k norms).
    pub fn apply_inplace(&self, ops: &O, x: &mut O::Buf) {
        ops.rmsnorm_inplace(x, &self.weight, self.eps);
    }

    /// Width of the scale.
    pub fn len(&self, ops: &O) -> usize {
        ops.vector_len(&self.weight)
    }
}
