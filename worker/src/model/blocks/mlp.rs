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
        self.apply(ops, &mut s.ws, &s.xn, &mut s.gate, &mut s.up, &mut s.proj);
    }

    /// `out = mlp(x)`, with `gate` and `up` as work rows (an expert runs on its own rows).
    pub fn apply(
        &self,
        ops: &O,
        ws: &mut O::Workspace,
        x: &O::Buf,
        gate: &mut O::Buf,
        up: &mut O::Buf,
        out: &mut O::Buf,
    ) {
        ops.matmul_many(ws, x, [(&self.gate, None, &mut *gate), (&self.up, None, &mut *up)]);
        ops.silu_mul_for_product(ws, gate, up, self.width);
        ops.matmul(ws, gate, &self.down, None, out);
    }

    /// gate, up, down.
    pub fn matrices(&self) -> [&O::Mat; 3] {
        [&self.gate, &self.up, &self.down]
    }
}
