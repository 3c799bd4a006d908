//! The gated (SwiGLU) MLP: `down(silu(gate(x)) · up(x))`.

use baton_shared::model_files::LoadError;

use super::super::arch::MlpTensors;
use super::super::loader::WeightLoader;
use super::super::scratch::Scratch;
use crate::ops::Ops;

/// A dense gated MLP.
pub struct GatedMlp<O: Ops> {
    gate: O::Mat,
    up: O::Mat,
    down: O::Mat,
    width: usize,
}

impl<O: Ops> GatedMlp<O> {
    /// Load the three matrices `t` names.
    pub fn load(w: &WeightLoader<'_, O>, t: &MlpTensors) -> Result<Self, LoadError> {
        Ok(Self {
            gate: w.matrix(&t.gate)?,
            up: w.matrix(&t.up)?,
            down: w.matrix(&t.down)?,
            width: t.gate.shape[0],
        })
    }

    /// `s.proj = mlp(s.xn)`.
    pub fn forward(&self, ops: &O, s: &mut Scratch<O>) {
        ops.matmul_many(
            &mut s.ws,
            &s.xn,
            [(&self.gate, None, &mut s.gate), (&self.up, None, &mut s.up)],
        );
        ops.silu_mul(&mut s.gate, &s.up, self.width);
        ops.matmul(&mut s.ws, &s.gate, &self.down, None, &mut s.proj);
    }

    /// gate, up, down.
    pub fn matrices(&self) -> [&O::Mat; 3] {
        [&self.gate, &self.up, &self.down]
    }
}
