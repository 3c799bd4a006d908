//! RMSNorm with a learned scale.

use baton_shared::model_files::{LoadError, TensorSpec};

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
        Ok(Self {
            weight: w.vector(spec)?,
            eps: w.config.rms_norm_eps,
        })
    }

    /// Normalize every row of `x` into `out`.
    pub fn apply(&self, ops: &O, x: &O::Buf, out: &mut O::Buf) {
        ops.rmsnorm(x, &self.weight, self.eps, out);
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
