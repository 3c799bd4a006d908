//! Work buffers of a forward pass, on the device the operations run on. They grow to the
//! largest batch seen and are then reused, so steady decoding allocates nothing.

use crate::ops::Ops;
use crate::ops::cpu::CpuOps;

/// Reusable device buffers for a stage's forward pass.
pub struct Scratch<O: Ops = CpuOps> {
    /// The residual stream.
    pub hidden: O::Buf,
    /// Normalized input of the block being run.
    pub xn: O::Buf,
    pub q: O::Buf,
    pub k: O::Buf,
    pub v: O::Buf,
    pub attn: O::Buf,
    /// A block's output, added to the residual stream.
    pub proj: O::Buf,
    pub gate: O::Buf,
    pub up: O::Buf,
    /// Router logits of a mixture-of-experts layer.
    pub router: O::Buf,
    /// The rows routed to one expert, and that expert's output for them.
    pub expert_in: O::Buf,
    pub expert_out: O::Buf,
    /// Which rows each expert takes.
    pub routing: O::Routing,
    /// What the mixture-of-experts layers of the last pass did.
    pub moe: MoeStats,
    /// Head output of the last stage.
    pub logits: O::Buf,
    /// The running sum of DFlash taps times their `fc` blocks, one row per batch row, while
    /// `tapping`; and one tap's product before it is added.
    pub taps: O::Buf,
    pub tap_product: O::Buf,
    pub tapping: bool,
    /// Per-call work memory of the operations.
    pub ws: O::Workspace,
    /// Host-side per-batch tables (kept to reuse their memory).
    pub batch: Batch,
    /// Each layer's seconds, summed over the passes since timing was turned on (the
    /// profiler's cost per layer class); `None` while not timing.
    pub layer_seconds: Option<Vec<f64>>,
}

impl<O: Ops> Scratch<O> {
    /// Start (`true`) or stop timing each layer; each layer's seconds timed so far (empty when
    /// timing was off). What every backend's `Backend::layer_times` does.
    pub fn layer_times(&mut self, on: bool) -> Vec<f64> {
        let times = self.layer_seconds.take().unwrap_or_default();
        self.layer_seconds = on.then(Vec::new);
        times
    }
}

impl<O: Ops> Default for Scratch<O> {
    fn default() -> Self {
        Self {
            hidden: O::Buf::default(),
            xn: O::Buf::default(),
            q: O::Buf::default(),
            k: O::Buf::default(),
            v: O::Buf::default(),
            attn: O::Buf::default(),
            proj: O::Buf::default(),
            gate: O::Buf::default(),
            up: O::Buf::default(),
            router: O::Buf::default(),
            expert_in: O::Buf::default(),
            expert_out: O::Buf::default(),
            routing: O::Routing::default(),
            moe: MoeStats::default(),
            logits: O::Buf::default(),
            taps: O::Buf::default(),
            tap_product: O::Buf::default(),
            tapping: false,
            ws: O::Workspace::default(),
            batch: Batch::default(),
            layer_seconds: None,
        }
    }
}

impl<O: Ops> std::fmt::Debug for Scratch<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratch").finish_non_exhaustive()
    }
}

/// Mixture-of-experts activity of one pass over a stage's layers.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MoeStats {
    /// Sparse layers run.
    pub layers: usize,
    /// Experts that had rows, summed over the layers whose count the host knows (each read its
    /// weights once): not those routed on the device, which the device counts.
    pub active_experts: usize,
    /// Layers counted in `active_experts`.
    pub counted_layers: usize,
    /// Of those layers, the ones whose experts ran in one go ([`crate::ops::Ops::routed_experts`]).
    pub one_go_layers: usize,
}

/// What every layer of one batch shares: each row's rotary tables (host memory: a device
/// operation uploads them if it needs to) and the longest sequence end.
#[derive(Debug, Default)]
pub struct Batch {
    /// `rows × head_dim/2` cosines, row by row.
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    /// The largest end position of any sequence in the batch.
    pub longest: usize,
}
