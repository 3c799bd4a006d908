//! The device operations layer: what a model's forward pass asks of a device, over buffers and
//! weights that live on that device. Model code ([`crate::model`]) is written once against
//! [`Ops`]; [`cpu::CpuOps`] runs it on this build's SIMD kernels, and a GPU implementation runs
//! the same model code unchanged.
//!
//! The boundary is deliberately coarse: one call per matrix product (or group of products that
//! share an input), per norm, per attention over a whole batch. A device can then launch one
//! kernel per call and keep activations resident; the host only sees rows where the model
//! explicitly uploads or downloads them (at a stage's edges).
//!
//! Operations an architecture needs are added here as new methods with their own buffer types
//! (mixture-of-experts routing has [`Ops::Routing`]; Gated DeltaNet is one coarse
//! [`Ops::linear_attention`] over the sequences' recurrent state); model code that does not
//! call them is untouched.

pub mod conformance;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use baton_shared::dtype::DType;

use crate::kernels::cpu::matmul::WeightFormat;
use crate::kv_cache::KvSpans;
use crate::model::ForwardError;

/// Which cached positions each query row attends to.
pub use crate::kernels::cpu::attention::AttnMask;
/// The shape of one attention call: query heads, K/V heads (grouped-query) and head width.
pub use crate::kernels::cpu::reference::AttnShape;

/// One product of [`Ops::matmul_many`]: weights, optional bias, output.
pub type Product<'a, O> = (
    &'a <O as Ops>::Mat,
    Option<&'a <O as Ops>::Vector>,
    &'a mut <O as Ops>::Buf,
);

/// A weight matrix as read from the files, before a device converts and uploads it.
#[derive(Debug, Clone, PartialEq)]
pub enum HostMatrix {
    /// Row-major f32 values (dequantized from whatever the file stores), `cols` wide.
    F32 { values: Vec<f32>, cols: usize },
    /// A file's ggml block bytes (Q8_0, Q4_0, Q4_1) in Hugging Face row order, kept as stored.
    Blocks {
        dtype: DType,
        bytes: Vec<u8>,
        rows: usize,
        cols: usize,
    },
}

/// The shape of one Gated DeltaNet call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearAttnShape {
    /// Query/key heads; each serves `value_heads / key_heads` value heads.
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    /// Taps of the causal conv1d.
    pub conv_kernel: usize,
    /// Value heads are ordered key-head-minor (value head `h` reads key head `h % key_heads`,
    /// as llama.cpp's Qwen3.5 GGUF files store them) instead of grouped by key head (key head
    /// `h / (value_heads / key_heads)`, as Hugging Face's).
    pub value_heads_tiled: bool,
}

impl LinearAttnShape {
    /// The key head value head `h` reads its queries and keys from.
    pub fn key_head(&self, h: usize) -> usize {
        match self.value_heads_tiled {
            true => h % self.key_heads,
            false => h / (self.value_heads / self.key_heads),
        }
    }

    /// Width of the concatenated query (or key) heads.
    pub fn keys(&self) -> usize {
        self.key_heads * self.key_head_dim
    }

    /// Width of the concatenated value heads.
    pub fn values(&self) -> usize {
        self.value_heads * self.value_head_dim
    }

    /// Channels of the conv1d: queries, keys and values.
    pub fn channels(&self) -> usize {
        2 * self.keys() + self.values()
    }

    /// f32 values of the conv part of a sequence's state (its last `kernel - 1` input rows);
    /// the delta rule's matrices follow it.
    pub fn conv_state(&self) -> usize {
        (self.conv_kernel - 1) * self.channels()
    }

    /// f32 values of a sequence's whole state.
    pub fn state_values(&self) -> usize {
        self.conv_state() + self.value_heads * self.key_head_dim * self.value_head_dim
    }
}

/// What a device reports about how it computes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpsInfo {
    /// The kernel path (`avx512_vnni`, `avx2`, …) or the device's name.
    pub kernels: String,
    /// Threads (CPU) or streams the operations run on.
    pub threads: usize,
}

/// The operations a decoder model needs from a device.
///
/// Buffers hold `f32` rows; their length is set by [`Ops::resize`] before a call writes them,
/// and every call's row count follows from its buffers' lengths.
pub trait Ops: Send + Sync + Sized + 'static {
    /// Activation rows on the device (grown on demand, reused across calls).
    type Buf: Default + Send;
    /// A weight matrix on the device, in the format it was uploaded in.
    type Mat: Send + Sync;
    /// A weight vector on the device (norm scales, biases).
    type Vector: Send + Sync;
    /// The K/V of one batch: the positions each sequence holds (host metadata every device
    /// needs) and the device storage the attention reads and writes.
    type Kv<'a>: KvSpans + ?Sized
    where
        Self: 'a;
    /// Per-call work memory an implementation keeps between calls (quantized activations,
    /// attention scores).
    type Workspace: Default + Send;
    /// Which rows of a batch go to which mixture-of-experts expert, with what weight.
    type Routing: Default + Send;
    /// A mixture's experts prepared to run in one go ([`routed_experts`](Self::routed_experts)).
    type Experts: Send + Sync;

    /// The kernel path and threads.
    fn info(&self) -> OpsInfo;

    /// Convert a matrix to `format` (f32 values) or keep its blocks, and upload it; each
    /// device packs weights its own way. The error says why the blocks cannot be used.
    fn matrix(&self, m: HostMatrix, format: WeightFormat) -> Result<Self::Mat, String>;
    /// Upload an f32 vector.
    fn vector(&self, v: Vec<f32>) -> Self::Vector;
    /// Bytes a matrix occupies on the device.
    fn matrix_bytes(&self, m: &Self::Mat) -> usize;
    /// Values in a vector.
    fn vector_len(&self, v: &Self::Vector) -> usize;

    /// Make `buf` hold `len` values (contents unspecified until written).
    fn resize(&self, buf: &mut Self::Buf, len: usize);
    /// Values `buf` holds.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Copy host rows into `buf` (resized to fit).
    fn upload(&self, host: &[f32], buf: &mut Self::Buf);
    /// Copy `buf` to host rows of the same length.
    fn download(&self, buf: &Self::Buf, host: &mut [f32]);

    /// Gather rows `tokens` of `table` (`[vocab, width]`, held as f32) into `out`.
    fn embed(&self, table: &Self::Mat, tokens: &[u32], out: &mut Self::Buf) -> Result<(), ForwardError>;
    /// `out = x · wᵀ (+ bias)` for every row of `x`.
    fn matmul(
        &self,
        ws: &mut Self::Workspace,
        x: &Self::Buf,
        w: &Self::Mat,
        bias: Option<&Self::Vector>,
        out: &mut Self::Buf,
    );
    /// Several products of the same `x` (q/k/v, gate/up) as one job; each output equals its
    /// own [`matmul`](Self::matmul).
    fn matmul_many<const N: usize>(&self, ws: &mut Self::Workspace, x: &Self::Buf, products: [Product<'_, Self>; N]);
    /// RMSNorm of each `w.len()`-wide row of `x` into `out`.
    fn rmsnorm(&self, x: &Self::Buf, w: &Self::Vector, eps: f32, out: &mut Self::Buf);
    /// RMSNorm of each `w.len()`-wide piece of `x` in place (per-head q/k norms).
    fn rmsnorm_inplace(&self, x: &mut Self::Buf, w: &Self::Vector, eps: f32);
    /// Rotate-half RoPE of the first `rotary_dim` values of every `head_dim`-wide head of each
    /// `width`-wide row of `x` (the rest pass through); row `i` uses `cos[i * rotary_dim / 2..]`
    /// and `sin[i * rotary_dim / 2..]` (host tables).
    fn rope(&self, x: &mut Self::Buf, width: usize, head_dim: usize, rotary_dim: usize, cos: &[f32], sin: &[f32]);
    /// Split each `2 · piece`-wide run of `x` into its first half (to `a`) and second (to `b`):
    /// a gated attention's queries and gates, which its `q` projection interleaves per head.
    fn deinterleave(&self, x: &Self::Buf, piece: usize, a: &mut Self::Buf, b: &mut Self::Buf);
    /// `x *= sigmoid(gate)`, element by element.
    fn sigmoid_mul(&self, x: &mut Self::Buf, gate: &Self::Buf);
    /// `out[row] += sigmoid(gate[row]) · y[row]`: one gate value per row (a shared expert).
    fn add_sigmoid_scaled(&self, out: &mut Self::Buf, y: &Self::Buf, gate: &Self::Buf);
    /// RMSNorm of each `w.len()`-wide piece of `x` in place, times `silu(z)` element by element.
    fn rmsnorm_gated(&self, x: &mut Self::Buf, w: &Self::Vector, eps: f32, z: &Self::Buf);
    /// `gate = silu(gate) · up` over `width`-wide rows.
    fn silu_mul(&self, gate: &mut Self::Buf, up: &Self::Buf, width: usize);
    /// `x += y` (the residual stream).
    fn add(&self, x: &mut Self::Buf, y: &Self::Buf);
    /// Make `buf` hold `len` zeros.
    fn zeros(&self, buf: &mut Self::Buf, len: usize);

    // Fused forms. Each default is the plain operations in turn; a device overrides one to do
    // the same work in fewer passes (a GPU: fewer launches), with the same bits.

    /// [`rmsnorm`](Self::rmsnorm) of `x` into `out` when the next call is a product over
    /// `out` with `ws`: a device may prepare `out` for it in `ws` (quantized activations).
    fn rmsnorm_for_product(
        &self,
        ws: &mut Self::Workspace,
        x: &Self::Buf,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Buf,
    ) {
        let _ = ws;
        self.rmsnorm(x, w, eps, out);
    }
    /// `x += y`, then [`rmsnorm_for_product`](Self::rmsnorm_for_product) of `x` into `out`.
    fn add_rmsnorm_for_product(
        &self,
        ws: &mut Self::Workspace,
        x: &mut Self::Buf,
        y: &Self::Buf,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Buf,
    ) {
        self.add(x, y);
        self.rmsnorm_for_product(ws, x, w, eps, out);
    }
    /// [`silu_mul`](Self::silu_mul) when the next call is a product over `gate` with `ws`
    /// (prepared as [`rmsnorm_for_product`](Self::rmsnorm_for_product) prepares its output).
    fn silu_mul_for_product(&self, ws: &mut Self::Workspace, gate: &mut Self::Buf, up: &Self::Buf, width: usize) {
        let _ = ws;
        self.silu_mul(gate, up, width);
    }
    /// [`rope`](Self::rope) of the queries `q` (`q_width` wide) and of the keys `k` (`k_width`)
    /// of the same rows and positions.
    #[allow(clippy::too_many_arguments)]
    fn rope_qk(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        (q_width, k_width): (usize, usize),
        head_dim: usize,
        rotary_dim: usize,
        cos: &[f32],
        sin: &[f32],
    ) {
        self.rope(q, q_width, head_dim, rotary_dim, cos, sin);
        self.rope(k, k_width, head_dim, rotary_dim, cos, sin);
    }
    /// Route each `experts`-wide row of router `logits`: softmax over experts, the `top_k`
    /// largest probabilities (renormalized to sum to one when `normalize`), grouped by expert.
    fn route(&self, logits: &Self::Buf, experts: usize, top_k: usize, normalize: bool, routing: &mut Self::Routing);
    /// Whether this device routes a mixture of `experts` experts, `top_k` a row, whose experts
    /// run in one go ([`routed_experts`](Self::routed_experts)) on itself
    /// ([`route_on_device`](Self::route_on_device)), so the host never waits for its logits.
    fn routes_on_device(&self, _experts: usize, _top_k: usize) -> bool {
        false
    }
    /// [`route`](Self::route) without the host: the routing stays on the device, for
    /// [`routed_experts`](Self::routed_experts) alone, where
    /// [`routes_on_device`](Self::routes_on_device) says so. A row takes the experts `route`
    /// would give it but where the device's `exp` moves a (near) tie of probabilities.
    fn route_on_device(
        &self,
        logits: &Self::Buf,
        experts: usize,
        top_k: usize,
        normalize: bool,
        routing: &mut Self::Routing,
    ) {
        self.route(logits, experts, top_k, normalize, routing);
    }
    /// The rows of `x` routed to `expert`, packed into `out` (resized to fit); how many there
    /// are (0: the expert is idle in this batch).
    fn gather_routed(&self, x: &Self::Buf, routing: &Self::Routing, expert: usize, out: &mut Self::Buf) -> usize;
    /// `out[row] += weight · y[i]` for the `i`-th row routed to `expert`.
    fn scatter_routed(&self, y: &Self::Buf, routing: &Self::Routing, expert: usize, out: &mut Self::Buf);
    /// Prepare the experts (`[gate, up, down]` each) of one mixture to run in one go, or `None`
    /// where this device runs them expert by expert: the CPU, whose products cost nothing to
    /// start, and a GPU for weight formats without a one-go kernel.
    fn experts(&self, experts: &[[&Self::Mat; 3]]) -> Option<Self::Experts>;
    /// Every expert of `experts` over the rows `routing` sends it: its gated MLP's outputs
    /// weighted and summed into `out` (resized to `x`'s length), which is what zeroing `out`,
    /// then [`gather_routed`](Self::gather_routed), gate and up, [`silu_mul`](Self::silu_mul),
    /// down and [`scatter_routed`](Self::scatter_routed) expert by expert compute, bit for bit.
    /// `scratch` holds the gate, up and down outputs. Returns the experts that had rows, where
    /// the host knows (not for a routing left on the device).
    fn routed_experts(
        &self,
        ws: &mut Self::Workspace,
        x: &Self::Buf,
        routing: &Self::Routing,
        experts: &Self::Experts,
        scratch: [&mut Self::Buf; 3],
        out: &mut Self::Buf,
    ) -> Option<usize>;
    /// Qwen3-Next's fused projections in the order [`linear_attention`](Self::linear_attention)
    /// takes: `qkvz` (per key head: q, k, then its value heads' v and z) into `qkv` (every q,
    /// every k, every v) and `z`; `ba` (per key head: its value heads' b, then their a) into
    /// `b` and `a`.
    #[allow(clippy::too_many_arguments)]
    fn split_qkvz(
        &self,
        qkvz: &Self::Buf,
        ba: &Self::Buf,
        shape: LinearAttnShape,
        qkv: &mut Self::Buf,
        z: &mut Self::Buf,
        b: &mut Self::Buf,
        a: &mut Self::Buf,
    );
    /// Gated DeltaNet over every sequence of `kv`, its state in slot `layer`: the conv1d (taps
    /// `[kernel, channels]`) with SiLU over `qkv` (every q, every k, every v); `beta =
    /// sigmoid(b)`, decay `exp(a_rate · softplus(a + dt_bias))` per value head; L2-normed q
    /// (scaled by `1/sqrt(key_head_dim)`) and k; the delta rule, each value head reading its
    /// key head's q and k; into `out` (`values` wide). `params` is `[conv taps, dt_bias,
    /// a_rate]`.
    #[allow(clippy::too_many_arguments)]
    fn linear_attention(
        &self,
        ws: &mut Self::Workspace,
        layer: usize,
        qkv: &Self::Buf,
        b: &Self::Buf,
        a: &Self::Buf,
        params: [&Self::Vector; 3],
        shape: LinearAttnShape,
        kv: &mut Self::Kv<'_>,
        out: &mut Self::Buf,
    );
    /// Store each sequence's new K/V rows of `layer` in `kv` (rows with no query: a DFlash
    /// draft's context).
    fn store_kv(&self, layer: usize, k: &Self::Buf, v: &Self::Buf, kv: &mut Self::Kv<'_>);
    /// Store each sequence's new K/V rows of `layer` in `kv`, then attention of every query
    /// row over its own sequence's cache, as `mask` says, into `out`. `longest` is the largest
    /// end position in the batch.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        ws: &mut Self::Workspace,
        layer: usize,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        kv: &mut Self::Kv<'_>,
        shape: AttnShape,
        mask: AttnMask,
        longest: usize,
        out: &mut Self::Buf,
    );
    /// Wait until the work queued so far has finished, so host-side timing means device time.
    /// The CPU's operations finish before they return.
    fn finish(&self) {}
}
