//! [`Ops`] on an NVIDIA GPU: weights, K/V and activations stay in GPU memory; host rows cross
//! only where the model uploads or downloads them (a stage's edges). Every kernel is Baton's
//! own ([`crate::kernels::cuda`]), compiled ahead of time into this binary.
//!
//! Errors of the driver (a failed launch, memory exhausted) are recorded where they happen
//! and reported by the backend after the call ([`Gpu::take_error`]), since the operations
//! themselves return nothing.
//!
//! What runs here: dense decoders (Llama, Qwen2, Qwen3), mixtures of experts (Qwen3-MoE) and
//! the hybrids' Gated DeltaNet layers (Qwen3-Next, Qwen3.5), with f32, f16/bf16 (held at 16
//! bits, widened in the product), Q8_0, Q4_0 and Q4_1 weights, f32 or f16 K/V and f32
//! recurrent state.

pub mod device;
pub mod graphs;
pub mod kv;
pub mod pinned;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, ValidAsZeroBits};

use super::{AttnMask, AttnShape, HostMatrix, LinearAttnShape, Ops, OpsInfo, Product};
use crate::kernels::cpu::half::HalfKind;
use crate::kernels::cpu::matmul::WeightFormat;
use crate::kernels::cpu::moe;
use baton_shared::dtype::DType;

use crate::kernels::cuda::experts::{
    ExpertPlan, ExpertQ4, ExpertQ8, MAX_TILES_PER_LAUNCH, Packed, align_geometry, device_layout, experts_geometry,
    max_tiles, pack, route_geometry, routes_on_device,
};
use crate::kernels::cuda::linear::{self, LinearSeq};
use crate::kernels::cuda::{self as geometry, MatmulGroup, Q4Device, Q8Device, Q8Kernel, Q8Plan, Q8Timing, SampleRow};
use crate::model::ForwardError;
pub use device::{CudaError, Gpu, GpuInfo, KernelTime};
use graphs::Args;
pub use graphs::{GraphCounts, GraphKey, RegionEnd};
use kv::KvStore;
pub use kv::{CudaBatch, CudaKvPool};
use pinned::PinnedRows;

/// A kernel parameter as the kernel receives it: a buffer as its device address, a scalar or
/// a `repr(C)` struct as its bytes.
trait KernelArg {
    fn put(&self, args: &mut Args);
}

impl<T> KernelArg for &CudaSlice<T> {
    fn put(&self, args: &mut Args) {
        let (ptr, _sync) = self.device_ptr(self.stream());
        args.push_bytes(&ptr.to_ne_bytes());
    }
}

/// Scalars and `repr(C)` structs passed by value.
macro_rules! by_value {
    ($($t:ty),*) => {$(
        impl KernelArg for &$t {
            fn put(&self, args: &mut Args) {
                // SAFETY: a plain-data value (`DeviceRepr`) viewed as its bytes.
                let bytes = unsafe { std::slice::from_raw_parts((*self as *const $t).cast::<u8>(), size_of::<$t>()) };
                args.push_bytes(bytes);
            }
        }
    )*};
}
by_value!(i32, u32, u64, f32, MatmulGroup);

/// Launch kernel `$name` with `$geom` and the arguments in order (the kernel's parameters in
/// kernels/cuda/*.cu, in order and type, every buffer holding what the geometry covers); a
/// failure is recorded. Within a region the launch may go into a graph ([`graphs`]).
macro_rules! launch {
    ($gpu:expr, $name:expr, $geom:expr, $($arg:expr),* $(,)?) => {{
        let mut args = graphs::Args::default();
        $( KernelArg::put(&$arg, &mut args); )*
        $gpu.launch($name, $geom, &mut args);
    }};
}

/// A GPU as a device.
#[derive(Clone)]
pub struct CudaOps {
    gpu: Arc<Gpu>,
    staging: Arc<Mutex<Staging>>,
    /// The Q8_0 product kernel of each batch size now ([`Q8Plan::to_bits`]), shared by the
    /// clones so a stage's model sees a switch ([`CudaOps::set_planned_products`]).
    q8: Arc<AtomicU32>,
    /// The plan chosen at open: timed among the kernels that gave `matmul_q8`'s bits
    /// ([`CudaOps::open`]).
    q8_chosen: Q8Plan,
    /// What the plan was chosen from (empty when not timed).
    q8_timings: Arc<[Q8Timing]>,
    /// Whether one-go mixtures are routed on the GPU ([`device::device_routing_wanted`]);
    /// shared by the clones, so a stage's model sees a switch.
    device_routing: Arc<AtomicBool>,
}

impl std::fmt::Debug for CudaOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaOps").field("gpu", &self.gpu.info).finish()
    }
}

/// Small per-call uploads (token ids, RoPE tables), kept between calls; the RoPE tables are
/// uploaded once per forward, not once per layer.
#[derive(Default)]
struct Staging {
    tokens: Option<CudaSlice<u32>>,
    cos: Option<CudaSlice<f32>>,
    sin: Option<CudaSlice<f32>>,
    cos_host: Vec<f32>,
    sin_host: Vec<f32>,
    /// The region ([`Gpu::region_epoch`]) the tables were uploaded in: a step that did not
    /// run may have left them unuploaded, so each region uploads its own.
    tables_epoch: u64,
    ids: Option<CudaSlice<u32>>,
    sample_rows: Option<CudaSlice<SampleRow>>,
    /// Page-locked buffers for the rows uploaded and downloaded (made on first use).
    rows_in: Option<PinnedRows>,
    rows_out: Option<PinnedRows>,
    /// Experts that had entries in the routings made on the device since the host last read
    /// it (`align_experts` adds to it; [`CudaOps::take_device_routed_experts`] reads it).
    routed_experts: Option<CudaSlice<u32>>,
}

/// f32 rows in GPU memory; keeps its largest allocation.
#[derive(Default)]
pub struct CudaBuf {
    data: Option<CudaSlice<f32>>,
    len: usize,
}

/// A weight matrix in GPU memory.
pub enum CudaMat {
    F32 {
        w: CudaSlice<f32>,
        rows: usize,
        cols: usize,
    },
    /// f16 or bf16 bits, widened to f32 as the product reads them.
    Half {
        w: CudaSlice<u16>,
        kind: HalfKind,
        rows: usize,
        cols: usize,
    },
    Q8 {
        q: CudaSlice<i8>,
        d: CudaSlice<u16>,
        rows: usize,
        cols: usize,
    },
    /// Q4_0 (`m` is `None`: the minimum is `-8 d`) or Q4_1.
    Q4 {
        codes: CudaSlice<u8>,
        d: CudaSlice<u16>,
        m: Option<CudaSlice<u16>>,
        rows: usize,
        cols: usize,
    },
}

/// Which product kernel a matrix takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    F32,
    F16,
    Bf16,
    Q8,
    Q4,
}

impl Kind {
    /// Every kind, in the order a step's products are launched.
    const ALL: [Kind; 5] = [Kind::F32, Kind::F16, Kind::Bf16, Kind::Q8, Kind::Q4];

    /// Whether its product reads the f32 activations as they are (no quantization).
    fn reads_f32(self) -> bool {
        matches!(self, Kind::F32 | Kind::F16 | Kind::Bf16)
    }
}

impl CudaMat {
    fn shape(&self) -> (usize, usize) {
        match self {
            CudaMat::F32 { rows, cols, .. }
            | CudaMat::Half { rows, cols, .. }
            | CudaMat::Q8 { rows, cols, .. }
            | CudaMat::Q4 { rows, cols, .. } => (*rows, *cols),
        }
    }

    fn kind(&self) -> Kind {
        match self {
            CudaMat::F32 { .. } => Kind::F32,
            CudaMat::Half {
                kind: HalfKind::F16, ..
            } => Kind::F16,
            CudaMat::Half {
                kind: HalfKind::Bf16, ..
            } => Kind::Bf16,
            CudaMat::Q8 { .. } => Kind::Q8,
            CudaMat::Q4 { .. } => Kind::Q4,
        }
    }
}

/// An f32 vector in GPU memory.
pub struct CudaVector {
    data: CudaSlice<f32>,
    len: usize,
}

/// Quantized activations for Q8_0 products; linear attention's conv output.
#[derive(Default)]
pub struct CudaWorkspace {
    xq: Option<CudaSlice<i8>>,
    xd: Option<CudaSlice<f32>>,
    /// Which rows `xq`/`xd` hold, when a fused operation quantized them for the next product.
    prepared: Option<Prepared>,
    conv: Option<CudaSlice<f32>>,
}

/// Rows a fused operation (`rmsnorm_q8`, `silu_mul_q8`) left quantized in a workspace: valid
/// for the next product only if it reads the same buffer and the GPU's [`Gpu::mark`] has not
/// moved since (no launch or copy could have changed the rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Prepared {
    rows_at: u64,
    values: usize,
    mark: u64,
}

// SAFETY: `MatmulGroup` is `repr(C)` plain data laid out as matmul.cu's `Group` (checked by a
// test), passed by value as a kernel parameter.
unsafe impl DeviceRepr for MatmulGroup {}
// SAFETY: `SampleRow` is `repr(C)` plain data laid out as sampling.cu's `SampleRow`, read by
// the kernel from an array in GPU memory; all-zero bits are a valid value.
unsafe impl DeviceRepr for SampleRow {}
unsafe impl ValidAsZeroBits for SampleRow {}
// SAFETY: `LinearSeq` is `repr(C)` plain data (five i32) laid out as linear_attention.cu's
// `LinearSeq`, read from an array in GPU memory; all-zero bits are a valid value.
unsafe impl DeviceRepr for LinearSeq {}
unsafe impl ValidAsZeroBits for LinearSeq {}

/// Which rows of a batch go to which expert, made one of two ways:
///
/// * on the host ([`Ops::route`]): the router's logits are downloaded and routed by the CPU's
///   own [`moe::route`], so a row picks the experts it picks on the CPU. Expert by expert, the
///   host needs each expert's row count to size its products. What the kernels read (each
///   entry's row and weight, expert after expert; the one-go plan's tiles and each row's
///   entries) is packed into one upload per layer;
/// * on the device ([`Ops::route_on_device`], experts in one go only): `route_rows` and
///   `align_experts` write the same words in place, with room for the most tiles the entries
///   can need, so nothing waits and the step can be a graph.
#[derive(Default)]
pub struct CudaRouting {
    host: moe::Routing,
    plan: ExpertPlan,
    logits: Vec<f32>,
    packed: Vec<u32>,
    dev: Option<CudaSlice<u32>>,
    at: Packed,
    /// Set when the last routing was made on the device.
    device: Option<DeviceRouting>,
    /// `route_rows`' picks: each entry's expert, then its weight (f32 bits).
    picks: Option<CudaSlice<u32>>,
}

/// The shape of a routing made on the device (the host never sees its contents).
#[derive(Debug, Clone, Copy)]
struct DeviceRouting {
    rows: usize,
    top_k: usize,
    /// Tiles the one-go kernels' grids cover ([`max_tiles`]).
    tiles: usize,
}

impl CudaRouting {
    /// The device address of word `at` of the packed routing (`None` before the first upload).
    fn word(&self, ops: &CudaOps, at: usize) -> Option<u64> {
        self.dev.as_ref().map(|d| ops.address(d) + 4 * at as u64)
    }

    /// Rows routed and experts per row.
    fn shape(&self) -> (usize, usize) {
        match self.device {
            Some(d) => (d.rows, d.top_k),
            None => (self.host.rows(), self.host.top_k()),
        }
    }

    /// Tiles the one-go kernels run over.
    fn tiles(&self) -> usize {
        self.device.map_or(self.plan.tiles.len(), |d| d.tiles)
    }

    /// Expert `expert`'s span of a routing made on the host; `None` (an error recorded) for
    /// one made on the device, whose spans only the device knows.
    fn host_span(&self, ops: &CudaOps, expert: usize) -> Option<std::ops::Range<usize>> {
        if self.device.is_some() {
            ops.gpu
                .record("a routing made on the device was read expert by expert".into());
            return None;
        }
        Some(self.host.span(expert))
    }
}

/// A mixture's Q8_0 or Q4 experts as `matmul_q8_experts` or `matmul_q4_experts` reads them: for
/// gate, up and down, a table of every expert's matrix (its `ExpertQ8` or `ExpertQ4` record, as
/// 64-bit words: addresses of matrices the model holds as long as it holds this).
pub struct CudaExperts {
    tables: [CudaSlice<u64>; 3],
    /// The kernel that reads the tables.
    kernel: &'static str,
    /// Gate/up rows (the MLP's width) and columns (the hidden size).
    ffn: usize,
    hidden: usize,
}

impl CudaOps {
    /// Operations on GPU `ordinal`, with each batch size's Q8_0 kernel chosen by timing
    /// ([`CudaOps::choose_q8_kernels`]).
    pub fn open(ordinal: u32) -> Result<Self, CudaError> {
        let mut ops = Self {
            gpu: Arc::new(Gpu::open(ordinal)?),
            staging: Arc::default(),
            q8: Arc::default(),
            q8_chosen: Q8Plan::only(Q8Kernel::Dp4a),
            q8_timings: Arc::new([]),
            device_routing: Arc::new(AtomicBool::new(device::device_routing_wanted())),
        };
        {
            let _span = tracing::info_span!("cuda.choose_q8_kernels", gpu = ordinal).entered();
            ops.choose_q8_kernels(ordinal);
        }
        ops.set_planned_products(true);
        let gpu = ordinal.to_string();
        for (kernel, from) in ops.q8_chosen.kernels.iter().zip(Q8Plan::FROM_ROWS) {
            let labels = [
                ("gpu", gpu.clone()),
                ("from_rows", from.to_string()),
                ("kernel", kernel.label().to_string()),
            ];
            metrics::gauge!("baton_cuda_q8_kernel", &labels).set(1.0);
        }
        for t in ops.q8_timings.iter() {
            let labels = [
                ("gpu", gpu.clone()),
                ("rows", t.rows.to_string()),
                ("kernel", t.kernel.label().to_string()),
            ];
            metrics::gauge!("baton_cuda_q8_kernel_seconds", &labels).set(t.seconds);
        }
        Ok(ops)
    }

    /// Every Q8_0 kernel that gives `matmul_q8`'s bits on a small product is timed at each of
    /// [`Q8Plan::FROM_ROWS`] on one Llama-3-8B layer's products (larger than any GPU's L2),
    /// and each size takes the fastest ([`Q8Plan::fastest`]); `BATON_CUDA_Q8_KERNEL` (`dp4a`, `mma`, `split32`, `split16`) picks one kernel
    /// for every size instead. Since all of them give the same bits, the choice moves speed,
    /// never a result.
    fn choose_q8_kernels(&mut self, ordinal: u32) {
        let agreeing = match self.q8_kernels_agreeing() {
            Ok(kernels) => kernels,
            Err(e) => {
                tracing::warn!(gpu = ordinal, error = %e, "checking the Q8_0 kernels against matmul_q8 failed; products use matmul_q8");
                return;
            }
        };
        for k in Q8Kernel::ALL.into_iter().filter(|k| !agreeing.contains(k)) {
            tracing::warn!(
                gpu = ordinal,
                kernel = k.name(),
                "differs from matmul_q8 on this GPU; not used"
            );
        }
        let wanted = std::env::var("BATON_CUDA_Q8_KERNEL").ok().filter(|v| !v.is_empty());
        if let Some(label) = wanted {
            match Q8Kernel::from_label(&label) {
                Some(k) if agreeing.contains(&k) => {
                    self.q8_chosen = Q8Plan::only(k);
                    tracing::info!(
                        gpu = ordinal,
                        kernel = k.name(),
                        "BATON_CUDA_Q8_KERNEL: every Q8_0 product"
                    );
                    return;
                }
                Some(k) => tracing::warn!(
                    gpu = ordinal,
                    kernel = k.name(),
                    "BATON_CUDA_Q8_KERNEL names a kernel that differs from matmul_q8 here; timing the others"
                ),
                None => tracing::warn!(
                    gpu = ordinal,
                    value = %label,
                    "BATON_CUDA_Q8_KERNEL is none of dp4a, mma, split32, split16; timing the kernels"
                ),
            }
        }
        // Timed once per GPU and process: a process that opens a GPU again (a device check
        // loading model after model) takes the same kernels. The lock is held while timing, so
        // two opens of one GPU never time against each other.
        static TIMED: Mutex<Vec<(u32, Arc<[Q8Timing]>)>> = Mutex::new(Vec::new());
        let mut timed = TIMED.lock().unwrap_or_else(|p| p.into_inner());
        let timings = match timed.iter().find(|(gpu, _)| *gpu == ordinal) {
            Some((_, t)) => t.clone(),
            None => match self.time_q8_kernels(&agreeing) {
                Ok(t) => {
                    let t: Arc<[Q8Timing]> = t.into();
                    timed.push((ordinal, t.clone()));
                    t
                }
                Err(e) => {
                    self.q8_chosen = Q8Plan::untimed(agreeing.contains(&Q8Kernel::Mma));
                    tracing::warn!(gpu = ordinal, error = %e, "timing the Q8_0 kernels failed");
                    return;
                }
            },
        };
        drop(timed);
        // Only kernels that agreed at this open (a timing kept from an earlier one may hold more).
        let usable: Vec<Q8Timing> = timings
            .iter()
            .filter(|t| agreeing.contains(&t.kernel))
            .copied()
            .collect();
        self.q8_chosen = Q8Plan::fastest(&usable);
        self.q8_timings = timings;
        tracing::info!(gpu = ordinal, plan = %self.q8_chosen, "Q8_0 product kernels by batch size");
    }

    /// The experts that had rows in the routings made on the device since the last call (a wait
    /// for the device; outside a region, as after a forward), the counter then zeroed; `None`
    /// before any such routing.
    pub fn take_device_routed_experts(&self) -> Option<u64> {
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let counter = staging.routed_experts.as_mut()?;
        let mut n = [0u32];
        let r = self.gpu.stream.memcpy_dtoh(&counter.slice(0..1), &mut n);
        self.gpu.check("reading the routed experts' count", r)?;
        let r = self.gpu.stream.memset_zeros(counter);
        self.gpu.check("zeroing the routed experts' count", r)?;
        self.gpu.check("synchronizing", self.gpu.stream.synchronize())?;
        Some(u64::from(n[0]))
    }

    /// Route one-go mixtures on the GPU (`true`) or on the host, from the next forward on.
    pub fn set_device_routing(&self, on: bool) {
        self.device_routing.store(on, Ordering::Relaxed);
    }

    /// These operations with Q8_0 products planned by `plan`, for measuring one kernel
    /// against another.
    pub fn with_q8_plan(&self, plan: Q8Plan) -> Self {
        Self {
            q8: Arc::new(AtomicU32::new(plan.to_bits())),
            q8_chosen: plan,
            ..self.clone()
        }
    }

    /// Which Q8_0 kernel each batch size takes.
    pub fn q8_plan(&self) -> Q8Plan {
        Q8Plan::from_bits(self.q8.load(Ordering::Relaxed))
    }

    /// Q8_0 products by the plan chosen at open (`true`), or all by `matmul_q8` (`false`: the
    /// reference, for measuring what the plan gains), from the next launch on.
    pub fn set_planned_products(&self, on: bool) {
        let plan = if on {
            self.q8_chosen
        } else {
            Q8Plan::only(Q8Kernel::Dp4a)
        };
        self.q8.store(plan.to_bits(), Ordering::Relaxed);
    }

    /// The timings the plan was chosen from (empty when it was not timed).
    pub fn q8_timings(&self) -> &[Q8Timing] {
        &self.q8_timings
    }

    /// The Q8_0 kernels that give `matmul_q8`'s bits on one small product, `matmul_q8` first:
    /// only those are used, so a row's result never depends on which kernel its batch took. The
    /// product: 88 weight rows (16-row tiles, the last part-way; two of `matmul_q8_mma`'s
    /// 64-row tiles), 41 activation rows (two of split32's 32-row blocks), a bias, 160 blocks a
    /// row (so the split kernels' warps loop more than once). A kernel that fails to launch is
    /// left out; `Err` only if `matmul_q8` itself fails.
    fn q8_kernels_agreeing(&self) -> Result<Vec<Q8Kernel>, String> {
        let (rows_w, cols, rows_x) = (88usize, 5120usize, 41usize);
        let wave = |n: usize, k: f32| -> Vec<f32> { (0..n).map(|i| ((i as f32) * k).sin()).collect() };
        let w = self.matrix(
            HostMatrix::F32 {
                values: wave(rows_w * cols, 0.37),
                cols,
            },
            WeightFormat::Q8_0,
        )?;
        let bias = self.vector(wave(rows_w, 1.3));
        let mut x = CudaBuf::default();
        self.upload(&wave(rows_x * cols, 0.11), &mut x);
        if let Some(e) = self.gpu.take_error() {
            return Err(e);
        }
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let mut reference: Option<Vec<u32>> = None;
        let mut agreeing = Vec::new();
        for k in Q8Kernel::ALL {
            let (mut ws, mut out) = (CudaWorkspace::default(), CudaBuf::default());
            let mut host = vec![0f32; rows_x * rows_w];
            self.with_q8_plan(Q8Plan::only(k))
                .matmul(&mut ws, &x, &w, Some(&bias), &mut out);
            self.download(&out, &mut host);
            match (self.gpu.take_error(), &reference) {
                (Some(e), None) => return Err(e),
                (Some(e), Some(_)) => tracing::warn!(kernel = k.name(), error = %e, "the Q8_0 kernel failed"),
                (None, None) => {
                    reference = Some(bits(&host));
                    agreeing.push(k);
                }
                (None, Some(want)) => {
                    if bits(&host) == *want {
                        agreeing.push(k);
                    }
                }
            }
        }
        Ok(agreeing)
    }

    /// Seconds per layer of each of `kernels` at each of [`Q8Plan::FROM_ROWS`]: the Q8_0
    /// products of one Llama-3-8B layer as a model launches them (q/k/v together, o, gate/up
    /// together, down: 229 MiB, so the weights stream from memory, not L2), each with its
    /// activations' quantization. The GPU is first kept busy for 50 ms (clocks up); then five
    /// rounds take each kernel in turn (the order turning each round), each time over enough
    /// layers to last about 2 ms, and a kernel's time is its median round. The weights are
    /// zero: a product's speed does not depend on its values.
    fn time_q8_kernels(&self, kernels: &[Q8Kernel]) -> Result<Vec<Q8Timing>, String> {
        let matrix = |rows: usize, cols: usize| -> Result<CudaMat, String> {
            let q = self.gpu.stream.alloc_zeros::<i8>(rows * cols);
            let d = self
                .gpu
                .stream
                .alloc_zeros::<u16>(rows * cols / baton_shared::dtype::QK);
            match (q, d) {
                (Ok(q), Ok(d)) => Ok(CudaMat::Q8 { q, d, rows, cols }),
                (Err(e), _) | (_, Err(e)) => Err(format!("allocating a {rows} × {cols} Q8_0 matrix: {e}")),
            }
        };
        let (hidden, kv, ffn) = (4096usize, 1024usize, 14336usize);
        let (q, k, v, o) = (
            matrix(hidden, hidden)?,
            matrix(kv, hidden)?,
            matrix(kv, hidden)?,
            matrix(hidden, hidden)?,
        );
        let (gate, up, down) = (matrix(ffn, hidden)?, matrix(ffn, hidden)?, matrix(hidden, ffn)?);
        let rows_max = Q8Plan::FROM_ROWS[Q8Plan::FROM_ROWS.len() - 1];
        let x_host: Vec<f32> = (0..rows_max * ffn).map(|i| ((i % 97) as f32 - 48.0) / 48.0).collect();
        let sync = || self.gpu.check("synchronizing", self.gpu.stream.synchronize());
        let plans: Vec<CudaOps> = kernels.iter().map(|&k| self.with_q8_plan(Q8Plan::only(k))).collect();
        let mut timings = Vec::new();
        for (size, rows) in Q8Plan::FROM_ROWS.into_iter().enumerate() {
            let (mut x, mut h) = (CudaBuf::default(), CudaBuf::default());
            self.upload(&x_host[..rows * hidden], &mut x);
            self.upload(&x_host[..rows * ffn], &mut h);
            let mut outs: [CudaBuf; 6] = Default::default();
            let mut ws = CudaWorkspace::default();
            let layer = |ops: &CudaOps, ws: &mut CudaWorkspace, outs: &mut [CudaBuf; 6]| {
                let [qo, ko, vo, oo, go, uo] = outs;
                ops.matmul_many(
                    ws,
                    &x,
                    [(&q, None, &mut *qo), (&k, None, &mut *ko), (&v, None, &mut *vo)],
                );
                ops.matmul(ws, &x, &o, None, oo);
                ops.matmul_many(ws, &x, [(&gate, None, &mut *go), (&up, None, &mut *uo)]);
                ops.matmul(ws, &h, &down, None, oo);
            };
            // Every kernel once (sizing the buffers), then the GPU busy for 50 ms before the
            // first size.
            for ops in &plans {
                layer(ops, &mut ws, &mut outs);
            }
            sync();
            let busy = if size == 0 { 0.05 } else { 0.0 };
            let t = std::time::Instant::now();
            while t.elapsed().as_secs_f64() < busy {
                layer(&plans[0], &mut ws, &mut outs);
                sync();
            }
            // Layers per round: about 2 ms of the first kernel.
            let t = std::time::Instant::now();
            layer(&plans[0], &mut ws, &mut outs);
            sync();
            let reps = ((0.002 / t.elapsed().as_secs_f64().max(1e-6)).ceil() as usize).clamp(1, 64);
            let mut rounds = vec![Vec::new(); plans.len()];
            for round in 0..5 {
                for i in 0..plans.len() {
                    let at = (i + round) % plans.len();
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        layer(&plans[at], &mut ws, &mut outs);
                    }
                    sync();
                    rounds[at].push(t.elapsed().as_secs_f64() / reps as f64);
                }
            }
            if let Some(e) = self.gpu.take_error() {
                return Err(e);
            }
            for (&kernel, mut r) in kernels.iter().zip(rounds) {
                r.sort_by(f64::total_cmp);
                timings.push(Q8Timing {
                    kernel,
                    rows,
                    seconds: r[r.len() / 2],
                });
            }
        }
        Ok(timings)
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Option<CudaSlice<T>> {
        self.gpu.check("allocating GPU memory", self.gpu.alloc_zeros::<T>(n))
    }

    /// `slot` grown to hold at least `n` values (what it held is not kept).
    fn reserve<T: DeviceRepr + ValidAsZeroBits>(&self, slot: &mut Option<CudaSlice<T>>, n: usize) {
        if slot.as_ref().is_none_or(|d| d.len() < n) {
            *slot = self.alloc::<T>(n);
        }
    }

    fn upload_new<T: DeviceRepr + ValidAsZeroBits>(&self, host: &[T]) -> Result<CudaSlice<T>, String> {
        self.gpu
            .stream
            .clone_htod(host)
            .map_err(|e| format!("uploading {} bytes to the GPU: {e}", size_of_val(host)))
    }

    /// Copy `host` into `dev` (grown when too small).
    fn stage<T: DeviceRepr + ValidAsZeroBits>(&self, host: &[T], dev: &mut Option<CudaSlice<T>>) -> bool {
        let r = self.gpu.upload_into(host, dev);
        self.gpu.check("uploading", r).is_some()
    }

    /// `slot`'s page-locked buffer, made on first use.
    fn pinned<'b>(&self, slot: &'b mut Option<PinnedRows>) -> Option<&'b mut PinnedRows> {
        if slot.is_none() {
            *slot = self
                .gpu
                .check("allocating page-locked memory", PinnedRows::new(&self.gpu.stream));
        }
        slot.as_mut()
    }

    fn dev<'b>(&self, buf: &'b CudaBuf) -> Option<&'b CudaSlice<f32>> {
        let d = buf.data.as_ref();
        if d.is_none() {
            self.gpu
                .record("an operation read a buffer that was never written".into());
        }
        d
    }

    /// The most likely token of each `vocab`-wide row of `logits` (first on ties), on the GPU.
    pub fn argmax_rows(&self, logits: &CudaBuf, vocab: usize, out: &mut Vec<u32>) {
        let rows = logits.len / vocab.max(1);
        out.clear();
        out.resize(rows, 0);
        if rows == 0 {
            return;
        }
        let Some(x) = self.dev(logits) else { return };
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        self.reserve(&mut staging.ids, rows);
        let Some(ids) = staging.ids.as_ref() else { return };
        let cols = vocab as i32;
        let g = geometry::block_per_row(rows, geometry::ARGMAX_THREADS);
        launch!(self.gpu, "argmax_rows", g, x, ids, &cols);
        self.download_ids(ids, out);
    }

    /// The first `out.len()` token ids of `ids` into `out`, once the work before is done.
    fn download_ids(&self, ids: &CudaSlice<u32>, out: &mut [u32]) {
        if !self.gpu.sync_point() {
            return;
        }
        let r = self.gpu.stream.memcpy_dtoh(&ids.slice(0..out.len()), out);
        self.gpu.check("downloading token ids", r);
        self.gpu.check("synchronizing", self.gpu.stream.synchronize());
    }

    /// The token each `vocab`-wide row of `logits` samples under its settings in `rows` (one
    /// per row: its temperature, top-k, top-p, min-p and draw), on the GPU; only the settings
    /// go up and the ids come back.
    pub fn sample_rows(&self, logits: &CudaBuf, vocab: usize, rows: &[SampleRow], out: &mut Vec<u32>) {
        let n = rows.len();
        out.clear();
        out.resize(n, 0);
        if n == 0 {
            return;
        }
        if logits.len < n * vocab {
            self.gpu
                .record(format!("sampling {n} rows of {vocab} from {} logits", logits.len));
            return;
        }
        let Some(x) = self.dev(logits) else { return };
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let Staging { ids, sample_rows, .. } = &mut *staging;
        if !self.stage(rows, sample_rows) {
            return;
        }
        self.reserve(ids, n);
        let (Some(ids), Some(settings)) = (ids.as_ref(), sample_rows.as_ref()) else {
            return;
        };
        let cols = vocab as i32;
        launch!(
            self.gpu,
            "sample_rows",
            geometry::block_per_row(n, geometry::SAMPLE_THREADS),
            x,
            settings,
            ids,
            &cols
        );
        self.download_ids(ids, out);
    }

    /// The workspace's quantized-activation buffers, grown to hold `values` values.
    fn quantized_rows<'w>(
        &self,
        ws: &'w mut CudaWorkspace,
        values: usize,
    ) -> Option<(&'w CudaSlice<i8>, &'w CudaSlice<f32>)> {
        self.reserve(&mut ws.xq, values);
        self.reserve(&mut ws.xd, values / baton_shared::dtype::QK);
        Some((ws.xq.as_ref()?, ws.xd.as_ref()?))
    }

    /// `silu_mul_q8`: `gate = silu(gate) · up` over `values` values (whole Q8_0 blocks), and
    /// the result quantized into `ws` in the same launch; false when `ws` has no room.
    fn silu_mul_q8(&self, ws: &mut CudaWorkspace, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, values: usize) -> bool {
        let Some((xq, xd)) = self.quantized_rows(ws, values) else {
            return false;
        };
        let blocks = values / baton_shared::dtype::QK;
        let n = blocks as u64;
        launch!(
            self.gpu,
            "silu_mul_q8",
            geometry::quantize_geometry(blocks),
            gate,
            up,
            xq,
            xd,
            &n
        );
        true
    }

    /// Remember that `ws` now holds the quantization of the `values` values at `rows`.
    fn prepared(&self, ws: &mut CudaWorkspace, rows: &CudaSlice<f32>, values: usize) {
        ws.prepared = Some(Prepared {
            rows_at: self.address(rows),
            values,
            mark: self.gpu.mark(),
        });
    }

    /// Whether `ws` holds, from a fused operation just before, the quantization of `x`.
    fn is_prepared(&self, ws: &mut CudaWorkspace, x: &CudaSlice<f32>, values: usize) -> bool {
        let want = Prepared {
            rows_at: self.address(x),
            values,
            mark: self.gpu.mark(),
        };
        ws.prepared.take() == Some(want)
    }

    fn quantize(&self, ws: &mut CudaWorkspace, x: &CudaSlice<f32>, values: usize) -> bool {
        let blocks = values / baton_shared::dtype::QK;
        let Some((xq, xd)) = self.quantized_rows(ws, values) else {
            return false;
        };
        let n = blocks as u64;
        launch!(
            self.gpu,
            "quantize_q8",
            geometry::quantize_geometry(blocks),
            x,
            xq,
            xd,
            &n
        );
        true
    }

    fn address<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (ptr, _sync) = s.device_ptr(&self.gpu.stream);
        ptr
    }

    /// One launch for `products` (all of one kind, at most [`geometry::GROUP`]) over the `t`
    /// rows of `x` (quantized formats: already quantized into `ws`).
    fn launch_group(
        &self,
        ws: &CudaWorkspace,
        x: &CudaSlice<f32>,
        t: usize,
        cols: usize,
        kind: Kind,
        products: &[(&CudaMat, Option<&CudaVector>, &CudaSlice<f32>)],
    ) {
        let mut g = MatmulGroup::default();
        for (i, (w, bias, out)) in products.iter().enumerate() {
            match w {
                CudaMat::F32 { w, rows, .. } => {
                    g.w[i] = self.address(w);
                    g.rows[i] = *rows as i32;
                }
                CudaMat::Half { w, rows, .. } => {
                    g.w[i] = self.address(w);
                    g.rows[i] = *rows as i32;
                }
                CudaMat::Q8 { q, d, rows, .. } => {
                    g.w[i] = self.address(q);
                    g.d[i] = self.address(d);
                    g.rows[i] = *rows as i32;
                }
                CudaMat::Q4 { codes, d, m, rows, .. } => {
                    g.w[i] = self.address(codes);
                    g.d[i] = self.address(d);
                    g.m[i] = m.as_ref().map_or(0, |m| self.address(m));
                    g.rows[i] = *rows as i32;
                }
            }
            g.bias[i] = bias.map_or(0, |b| self.address(&b.data));
            g.out[i] = self.address(*out);
        }
        let plain = |name| (name, geometry::matmul_geometry(t, g.total_rows()));
        let (name, geom) = match kind {
            Kind::F32 => plain("matmul_f32"),
            Kind::F16 => plain("matmul_f16"),
            Kind::Bf16 => plain("matmul_bf16"),
            Kind::Q8 => {
                let (kernel, geom) = self.q8_plan().launch(t, g.total_rows());
                (kernel.name(), geom)
            }
            Kind::Q4 => plain("matmul_q4"),
        };
        let (t32, c32) = (t as i32, cols as i32);
        if kind.reads_f32() {
            launch!(self.gpu, name, geom, x, &g, &t32, &c32);
            return;
        }
        let (Some(xq), Some(xd)) = (ws.xq.as_ref(), ws.xd.as_ref()) else {
            return;
        };
        launch!(self.gpu, name, geom, xq, xd, &g, &t32, &c32);
    }

    /// `matmul_q8_experts` of `table` over the plan's tiles (`(address, count)`) into `out`,
    /// the activations already quantized into `ws`; `rows_at` is the entries' row table, or 0
    /// when entry i reads activation row i.
    #[allow(clippy::too_many_arguments)]
    fn launch_experts(
        &self,
        ws: &CudaWorkspace,
        (kernel, table): (&'static str, &CudaSlice<u64>),
        (tiles_at, tiles): (u64, usize),
        rows_at: u64,
        out: &CudaSlice<f32>,
        rows_w: usize,
        cols: usize,
    ) {
        let (Some(xq), Some(xd)) = (ws.xq.as_ref(), ws.xd.as_ref()) else {
            return;
        };
        let (rw, c) = (rows_w as i32, cols as i32);
        // Three words a tile.
        for first in (0..tiles).step_by(MAX_TILES_PER_LAUNCH) {
            let count = (tiles - first).min(MAX_TILES_PER_LAUNCH);
            let at = tiles_at + 12 * first as u64;
            let g = experts_geometry(rows_w, count);
            launch!(self.gpu, kernel, g, xq, xd, table, &at, &rows_at, out, &rw, &c);
        }
    }

    /// The device's copy bandwidth: bytes read plus bytes written per second (as
    /// `bandwidthTest` counts a device-to-device copy), best of `reps` copies of `bytes`.
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64, CudaError> {
        let s = &self.gpu.stream;
        let err = |what: &'static str| {
            move |e: cudarc::driver::DriverError| CudaError::Driver {
                what,
                reason: e.to_string(),
            }
        };
        let a = s.alloc_zeros::<u8>(bytes).map_err(err("allocating the copy source"))?;
        let mut b = s.alloc_zeros::<u8>(bytes).map_err(err("allocating the copy target"))?;
        let mut best = f64::INFINITY;
        for _ in 0..reps.max(1) + 1 {
            s.synchronize().map_err(err("synchronizing"))?;
            let t = std::time::Instant::now();
            s.memcpy_dtod(&a, &mut b).map_err(err("copying"))?;
            s.synchronize().map_err(err("synchronizing"))?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(2.0 * bytes as f64 / best / 1e9)
    }

    /// The kernel for a pool's K/V type (`f32` or `f16`) and the layer's K and V addresses.
    fn kv_addresses(
        &self,
        k: &KvStore,
        v: &KvStore,
        f32: &'static str,
        f16: &'static str,
    ) -> Option<(&'static str, u64, u64)> {
        match (k, v) {
            (KvStore::F32(k), KvStore::F32(v)) => Some((f32, self.address(k), self.address(v))),
            (KvStore::F16(k), KvStore::F16(v)) => Some((f16, self.address(k), self.address(v))),
            _ => {
                self.gpu.record("K and V stores of different types".into());
                None
            }
        }
    }

    /// RMSNorm of each `w.len`-wide row of the `len` values of `x` into `out` (may be `x`).
    fn norm_rows(&self, x: &CudaSlice<f32>, len: usize, w: &CudaVector, eps: f32, out: &CudaSlice<f32>) {
        let width = w.len as i32;
        let g = geometry::norm_geometry(len / w.len.max(1), w.len);
        launch!(self.gpu, "rmsnorm", g, x, &w.data, out, &width, &eps);
    }

    /// `rmsnorm_q8`: `x += y` (when given), RMSNorm of `x` into `out` and `out` quantized into
    /// `ws` for the next product, in one launch; false (nothing done) where its rows are not
    /// whole Q8_0 blocks, for the caller to run the plain operations.
    fn norm_for_product(
        &self,
        ws: &mut CudaWorkspace,
        x: &CudaBuf,
        y: Option<&CudaBuf>,
        w: &CudaVector,
        eps: f32,
        out: &mut CudaBuf,
    ) -> bool {
        let (len, width) = (x.len, w.len);
        if width == 0 || !width.is_multiple_of(baton_shared::dtype::QK) || !len.is_multiple_of(width) {
            return false;
        }
        if y.is_some_and(|y| y.len != len) {
            self.gpu.record(format!(
                "adding {} values to a residual of {len}",
                y.map_or(0, |y| y.len)
            ));
            return true;
        }
        self.resize(out, len);
        let Some(xd) = self.dev(x) else { return true };
        let y_at = match y {
            Some(y) => match self.dev(y) {
                Some(yd) => self.address(yd),
                None => return true,
            },
            None => 0u64,
        };
        let Some(o) = out.data.as_ref() else { return true };
        let Some((xq, qd)) = self.quantized_rows(ws, len) else {
            return true;
        };
        let wi = width as i32;
        let g = geometry::norm_geometry(len / width, width);
        launch!(self.gpu, "rmsnorm_q8", g, xd, &y_at, &w.data, o, xq, qd, &wi, &eps);
        self.prepared(ws, o, len);
        true
    }

    /// The RoPE tables `cos` and `sin` on the GPU: uploaded only when they differ from the
    /// last ones (every layer of a forward rotates by the same positions).
    fn rope_tables<'s>(
        &self,
        st: &'s mut Staging,
        cos: &[f32],
        sin: &[f32],
    ) -> Option<(&'s CudaSlice<f32>, &'s CudaSlice<f32>)> {
        let epoch = self.gpu.region_epoch();
        if st.cos_host != cos || st.sin_host != sin || st.cos.is_none() || st.tables_epoch != epoch {
            if !(self.stage(cos, &mut st.cos) && self.stage(sin, &mut st.sin)) {
                return None;
            }
            st.tables_epoch = epoch;
            st.cos_host.clear();
            st.cos_host.extend_from_slice(cos);
            st.sin_host.clear();
            st.sin_host.extend_from_slice(sin);
        }
        Some((st.cos.as_ref()?, st.sin.as_ref()?))
    }
}

impl Ops for CudaOps {
    type Buf = CudaBuf;
    type Mat = CudaMat;
    type Vector = CudaVector;
    type Kv<'a> = CudaBatch<'a>;
    type Workspace = CudaWorkspace;
    type Routing = CudaRouting;
    type Experts = CudaExperts;

    fn info(&self) -> OpsInfo {
        OpsInfo {
            kernels: format!(
                "cuda sm_{} ({}){}",
                self.gpu.info.sm,
                self.gpu.info.name,
                match self.q8_plan().tensor_cores() {
                    true => ", int8 tensor cores",
                    false => "",
                }
            ),
            threads: 1,
        }
    }

    fn matrix(&self, m: HostMatrix, format: WeightFormat) -> Result<CudaMat, String> {
        let q8 = |dev: Q8Device| -> Result<CudaMat, String> {
            Ok(CudaMat::Q8 {
                q: self.upload_new(&dev.quants)?,
                d: self.upload_new(&dev.scales)?,
                rows: dev.rows,
                cols: dev.cols,
            })
        };
        let q4 = |dev: Q4Device| -> Result<CudaMat, String> {
            Ok(CudaMat::Q4 {
                codes: self.upload_new(&dev.codes)?,
                d: self.upload_new(&dev.scales)?,
                m: match dev.mins.is_empty() {
                    true => None,
                    false => Some(self.upload_new(&dev.mins)?),
                },
                rows: dev.rows,
                cols: dev.cols,
            })
        };
        match m {
            HostMatrix::Blocks {
                dtype: DType::Q8_0,
                bytes,
                rows,
                cols,
            } => q8(Q8Device::from_ggml(&bytes, rows, cols).map_err(|e| e.to_string())?),
            HostMatrix::Blocks {
                dtype: dtype @ (DType::Q4_0 | DType::Q4_1),
                bytes,
                rows,
                cols,
            } => q4(Q4Device::from_ggml(dtype, &bytes, rows, cols).map_err(|e| e.to_string())?),
            HostMatrix::Blocks { dtype, .. } => Err(format!("{dtype} is not a block format the GPU reads")),
            HostMatrix::F32 { values, cols } => {
                let rows = values.len() / cols.max(1);
                // 16-bit formats: rounded as the CPU rounds them and held at 16 bits; a matrix
                // past f16's range stays f32, as on the CPU.
                if let Some(kind) = format.half_kind().filter(|k| k.holds(&values)) {
                    let bits: Vec<u16> = values.iter().map(|&v| kind.from_f32(v)).collect();
                    return Ok(CudaMat::Half {
                        w: self.upload_new(&bits)?,
                        kind,
                        rows,
                        cols,
                    });
                }
                match format {
                    WeightFormat::Q8_0 if cols.is_multiple_of(baton_shared::dtype::QK) => {
                        let bytes = baton_shared::dtype::quantize_q8_0(&values);
                        q8(Q8Device::from_ggml(&bytes, rows, cols).map_err(|e| e.to_string())?)
                    }
                    WeightFormat::Q4_0 | WeightFormat::Q4_1 if cols.is_multiple_of(baton_shared::dtype::QK) => {
                        let (dtype, bytes) = match format {
                            WeightFormat::Q4_0 => (DType::Q4_0, baton_shared::dtype::quantize_q4_0(&values)),
                            _ => (DType::Q4_1, baton_shared::dtype::quantize_q4_1(&values)),
                        };
                        q4(Q4Device::from_ggml(dtype, &bytes, rows, cols).map_err(|e| e.to_string())?)
                    }
                    _ => Ok(CudaMat::F32 {
                        w: self.upload_new(&values)?,
                        rows,
                        cols,
                    }),
                }
            }
        }
    }

    fn vector(&self, v: Vec<f32>) -> CudaVector {
        let data = match self.upload_new(&v) {
            Ok(d) => d,
            Err(e) => {
                self.gpu.record(e);
                self.gpu.stream.null().expect("an empty device slice allocates nothing")
            }
        };
        CudaVector { data, len: v.len() }
    }

    fn matrix_bytes(&self, m: &CudaMat) -> usize {
        match m {
            CudaMat::F32 { w, .. } => 4 * w.len(),
            CudaMat::Half { w, .. } => 2 * w.len(),
            CudaMat::Q8 { q, d, .. } => q.len() + 2 * d.len(),
            CudaMat::Q4 { codes, d, m, .. } => codes.len() + 2 * (d.len() + m.as_ref().map_or(0, |m| m.len())),
        }
    }

    fn vector_len(&self, v: &CudaVector) -> usize {
        v.len
    }

    fn resize(&self, buf: &mut CudaBuf, len: usize) {
        if buf.data.as_ref().is_none_or(|d| d.len() < len) {
            buf.data = self.alloc::<f32>(len);
        }
        buf.len = len;
    }

    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }

    fn upload(&self, host: &[f32], buf: &mut CudaBuf) {
        self.resize(buf, host.len());
        let Some(d) = buf.data.as_ref() else { return };
        let dst = self.address(d);
        if self.gpu.region_upload(host, dst) {
            return;
        }
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let Some(pinned) = self.pinned(&mut staging.rows_in) else {
            return;
        };
        let r = pinned.upload(&self.gpu.stream, host, dst);
        self.gpu.check("uploading rows", r);
    }

    fn finish(&self) {
        if !self.gpu.sync_point() {
            return;
        }
        self.gpu.check("synchronizing", self.gpu.stream.synchronize());
    }

    fn download(&self, buf: &CudaBuf, host: &mut [f32]) {
        let Some(d) = self.dev(buf) else { return };
        // A step that did not run (to be run again) leaves the host rows as they were.
        if !self.gpu.sync_point() {
            return;
        }
        let n = host.len().min(buf.len);
        let src = self.address(d);
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let Some(pinned) = self.pinned(&mut staging.rows_out) else {
            return;
        };
        let r = pinned.download(&self.gpu.stream, src, &mut host[..n]);
        self.gpu.check("downloading rows", r);
    }

    fn embed(&self, table: &CudaMat, tokens: &[u32], out: &mut CudaBuf) -> Result<(), ForwardError> {
        let CudaMat::F32 { w, rows, cols } = table else {
            return Err(ForwardError::Device("the embedding table must be held as f32".into()));
        };
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= *rows) {
            return Err(ForwardError::TokenOutOfRange { id, vocab: *rows });
        }
        self.resize(out, tokens.len() * cols);
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if !self.stage(tokens, &mut staging.tokens) {
            return Err(ForwardError::Device("uploading token ids".into()));
        }
        let (Some(ids), Some(o)) = (staging.tokens.as_ref(), out.data.as_ref()) else {
            return Err(ForwardError::Device("GPU memory for the embedding".into()));
        };
        let c = *cols as i32;
        launch!(
            self.gpu,
            "embed_f32",
            geometry::copy_geometry(tokens.len(), *cols),
            w,
            ids,
            o,
            &c
        );
        Ok(())
    }

    fn matmul(&self, ws: &mut CudaWorkspace, x: &CudaBuf, w: &CudaMat, bias: Option<&CudaVector>, out: &mut CudaBuf) {
        self.matmul_many(ws, x, [(w, bias, out)]);
    }

    fn matmul_many<const N: usize>(&self, ws: &mut CudaWorkspace, x: &CudaBuf, mut products: [Product<'_, Self>; N]) {
        let Some(cols) = products.first().map(|p| p.0.shape().1) else {
            return;
        };
        let t = x.len / cols;
        let Some(xd) = self.dev(x) else { return };
        for (w, _, out) in products.iter_mut() {
            self.resize(out, t * w.shape().0);
        }
        // Quantized products share one quantization of the activations; each format's
        // products go out as one launch (a group of up to three).
        let quantized = products.iter().any(|p| !p.0.kind().reads_f32());
        let prepared = self.is_prepared(ws, xd, t * cols);
        if quantized && !prepared && !self.quantize(ws, xd, t * cols) {
            return;
        }
        for kind in Kind::ALL {
            let mut group = Vec::with_capacity(N);
            for (w, bias, out) in &products {
                if w.kind() != kind {
                    continue;
                }
                let Some(o) = out.data.as_ref() else { return };
                group.push((*w, *bias, o));
            }
            for chunk in group.chunks(geometry::GROUP) {
                self.launch_group(ws, xd, t, cols, kind, chunk);
            }
        }
    }

    fn rmsnorm(&self, x: &CudaBuf, w: &CudaVector, eps: f32, out: &mut CudaBuf) {
        self.resize(out, x.len);
        let (Some(xd), Some(o)) = (self.dev(x), out.data.as_ref()) else {
            return;
        };
        self.norm_rows(xd, x.len, w, eps, o);
    }

    fn rmsnorm_inplace(&self, x: &mut CudaBuf, w: &CudaVector, eps: f32) {
        let Some(xd) = self.dev(x) else { return };
        self.norm_rows(xd, x.len, w, eps, xd);
    }

    fn rope(&self, x: &mut CudaBuf, width: usize, head_dim: usize, rotary_dim: usize, cos: &[f32], sin: &[f32]) {
        let Some(xd) = self.dev(x) else { return };
        let rows = x.len / width;
        let half = rotary_dim / 2;
        let (cos, sin) = (&cos[..rows * half], &sin[..rows * half]);
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let Some((c, s)) = self.rope_tables(&mut staging, cos, sin) else {
            return;
        };
        let (r, w, hd, rd) = (rows as i32, width as i32, head_dim as i32, rotary_dim as i32);
        let n = rows * (width / head_dim) * half;
        launch!(
            self.gpu,
            "rope",
            geometry::elementwise_geometry(n),
            xd,
            c,
            s,
            &r,
            &w,
            &hd,
            &rd
        );
    }

    fn deinterleave(&self, x: &CudaBuf, piece: usize, a: &mut CudaBuf, b: &mut CudaBuf) {
        let half = x.len / 2;
        self.resize(a, half);
        self.resize(b, half);
        let (Some(xd), Some(ad), Some(bd)) = (self.dev(x), a.data.as_ref(), b.data.as_ref()) else {
            return;
        };
        let (p, n) = (piece as i32, half as u64);
        launch!(
            self.gpu,
            "deinterleave",
            geometry::elementwise_geometry(half),
            xd,
            ad,
            bd,
            &p,
            &n
        );
    }

    fn sigmoid_mul(&self, x: &mut CudaBuf, gate: &CudaBuf) {
        let (Some(xd), Some(g)) = (self.dev(x), self.dev(gate)) else {
            return;
        };
        let n = x.len as u64;
        launch!(
            self.gpu,
            "sigmoid_mul",
            geometry::elementwise_geometry(x.len),
            xd,
            g,
            &n
        );
    }

    fn add_sigmoid_scaled(&self, out: &mut CudaBuf, y: &CudaBuf, gate: &CudaBuf) {
        let rows = gate.len;
        let width = out.len / rows.max(1);
        let (Some(o), Some(yd), Some(g)) = (self.dev(out), self.dev(y), self.dev(gate)) else {
            return;
        };
        let w = width as i32;
        launch!(
            self.gpu,
            "add_sigmoid_scaled",
            geometry::copy_geometry(rows, width),
            o,
            yd,
            g,
            &w
        );
    }

    fn rmsnorm_gated(&self, x: &mut CudaBuf, w: &CudaVector, eps: f32, z: &CudaBuf) {
        let n = w.len;
        let pieces = x.len / n.max(1);
        let (Some(xd), Some(zd)) = (self.dev(x), self.dev(z)) else {
            return;
        };
        let n32 = n as i32;
        launch!(
            self.gpu,
            "rmsnorm_gated",
            geometry::copy_geometry(pieces, n),
            xd,
            &w.data,
            zd,
            &n32,
            &eps
        );
    }

    fn silu_mul(&self, gate: &mut CudaBuf, up: &CudaBuf, _width: usize) {
        let (Some(g), Some(u)) = (self.dev(gate), self.dev(up)) else {
            return;
        };
        let n = gate.len as u64;
        launch!(self.gpu, "silu_mul", geometry::elementwise_geometry(gate.len), g, u, &n);
    }

    fn add(&self, x: &mut CudaBuf, y: &CudaBuf) {
        let (Some(xd), Some(yd)) = (self.dev(x), self.dev(y)) else {
            return;
        };
        let n = x.len as u64;
        launch!(self.gpu, "add", geometry::elementwise_geometry(x.len), xd, yd, &n);
    }

    fn rmsnorm_for_product(&self, ws: &mut CudaWorkspace, x: &CudaBuf, w: &CudaVector, eps: f32, out: &mut CudaBuf) {
        if !self.norm_for_product(ws, x, None, w, eps, out) {
            self.rmsnorm(x, w, eps, out);
        }
    }

    fn add_rmsnorm_for_product(
        &self,
        ws: &mut CudaWorkspace,
        x: &mut CudaBuf,
        y: &CudaBuf,
        w: &CudaVector,
        eps: f32,
        out: &mut CudaBuf,
    ) {
        if !self.norm_for_product(ws, x, Some(y), w, eps, out) {
            self.add(x, y);
            self.rmsnorm(x, w, eps, out);
        }
    }

    fn silu_mul_for_product(&self, ws: &mut CudaWorkspace, gate: &mut CudaBuf, up: &CudaBuf, width: usize) {
        let n = gate.len;
        if !n.is_multiple_of(baton_shared::dtype::QK) {
            self.silu_mul(gate, up, width);
            return;
        }
        let (Some(g), Some(u)) = (self.dev(gate), self.dev(up)) else {
            return;
        };
        if self.silu_mul_q8(ws, g, u, n) {
            self.prepared(ws, g, n);
        }
    }

    fn rope_qk(
        &self,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        (q_width, k_width): (usize, usize),
        head_dim: usize,
        rotary_dim: usize,
        cos: &[f32],
        sin: &[f32],
    ) {
        let rows = q.len / q_width.max(1);
        if k.len != rows * k_width || q.len != rows * q_width {
            self.rope(q, q_width, head_dim, rotary_dim, cos, sin);
            self.rope(k, k_width, head_dim, rotary_dim, cos, sin);
            return;
        }
        let (Some(qd), Some(kd)) = (self.dev(q), self.dev(k)) else {
            return;
        };
        let half = rotary_dim / 2;
        let (cos, sin) = (&cos[..rows * half], &sin[..rows * half]);
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let Some((c, s)) = self.rope_tables(&mut staging, cos, sin) else {
            return;
        };
        let (hq, hk) = (q_width / head_dim, k_width / head_dim);
        let n = rows * (hq + hk) * half;
        let (r, hq, hk, hd, rd) = (rows as i32, hq as i32, hk as i32, head_dim as i32, rotary_dim as i32);
        launch!(
            self.gpu,
            "rope_qk",
            geometry::elementwise_geometry(n),
            qd,
            kd,
            c,
            s,
            &r,
            &hq,
            &hk,
            &hd,
            &rd
        );
    }

    fn zeros(&self, buf: &mut CudaBuf, len: usize) {
        self.resize(buf, len);
        if let Some(d) = buf.data.as_mut() {
            let r = self.gpu.zero(d, 0..len);
            self.gpu.check("zeroing", r);
        }
    }

    fn route(&self, logits: &CudaBuf, experts: usize, top_k: usize, normalize: bool, routing: &mut CudaRouting) {
        routing.device = None;
        routing.logits.resize(logits.len, 0.0);
        self.download(logits, &mut routing.logits);
        moe::route(&routing.logits, experts, top_k, normalize, &mut routing.host);
        routing.plan.build(&routing.host, experts);
        routing.at = pack(&routing.host, &routing.plan, &mut routing.packed);
        self.stage(&routing.packed, &mut routing.dev);
        // Each is a wait for the device: the stream drains before the logits cross.
        metrics::counter!("baton_cuda_moe_host_routes_total").increment(1);
    }

    fn routes_on_device(&self, experts: usize, top_k: usize) -> bool {
        self.device_routing.load(Ordering::Relaxed) && routes_on_device(experts, top_k)
    }

    fn route_on_device(
        &self,
        logits: &CudaBuf,
        experts: usize,
        top_k: usize,
        normalize: bool,
        routing: &mut CudaRouting,
    ) {
        if !self.routes_on_device(experts, top_k) {
            return self.route(logits, experts, top_k, normalize, routing);
        }
        let rows = logits.len / experts;
        let n = rows * top_k;
        let tiles = max_tiles(n, experts);
        let (at, words) = device_layout(n, tiles);
        routing.device = Some(DeviceRouting { rows, top_k, tiles });
        routing.at = at;
        metrics::counter!("baton_cuda_moe_device_routes_total").increment(1);
        if n == 0 {
            return;
        }
        // Powers of two, so a batch growing by a row rarely moves them (and a step's graph
        // keeps its addresses).
        self.reserve(&mut routing.picks, (2 * n).next_power_of_two());
        self.reserve(&mut routing.dev, words.next_power_of_two());
        let (Some(x), Some(picks), Some(packed)) = (self.dev(logits), routing.picks.as_ref(), routing.dev.as_ref())
        else {
            return;
        };
        let weights = self.address(picks) + 4 * n as u64;
        let counter = {
            let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
            self.reserve(&mut staging.routed_experts, 1);
            match staging.routed_experts.as_ref() {
                Some(c) => self.address(c),
                None => return,
            }
        };
        let (e, k, norm) = (experts as i32, top_k as i32, i32::from(normalize));
        launch!(
            self.gpu,
            "route_rows",
            route_geometry(rows),
            x,
            picks,
            &weights,
            &e,
            &k,
            &norm
        );
        let (r, t) = (rows as i32, tiles as i32);
        launch!(
            self.gpu,
            "align_experts",
            align_geometry(),
            picks,
            &weights,
            packed,
            &r,
            &k,
            &e,
            &t,
            &counter
        );
    }

    fn gather_routed(&self, x: &CudaBuf, routing: &CudaRouting, expert: usize, out: &mut CudaBuf) -> usize {
        let Some(span) = routing.host_span(self, expert) else {
            return 0;
        };
        let n = span.len();
        if n == 0 {
            return 0;
        }
        let width = x.len / routing.host.rows().max(1);
        self.resize(out, n * width);
        let (Some(xd), Some(o), Some(rows)) = (self.dev(x), out.data.as_ref(), routing.word(self, span.start)) else {
            return n;
        };
        let w = width as i32;
        launch!(
            self.gpu,
            "gather_rows",
            geometry::copy_geometry(n, width),
            xd,
            &rows,
            o,
            &w
        );
        n
    }

    fn scatter_routed(&self, y: &CudaBuf, routing: &CudaRouting, expert: usize, out: &mut CudaBuf) {
        let Some(span) = routing.host_span(self, expert) else {
            return;
        };
        let n = span.len();
        if n == 0 {
            return;
        }
        let width = y.len / n;
        let (Some(yd), Some(o), Some(rows), Some(weights)) = (
            self.dev(y),
            self.dev(out),
            routing.word(self, span.start),
            routing.word(self, routing.at.weights + span.start),
        ) else {
            return;
        };
        let w = width as i32;
        launch!(
            self.gpu,
            "scatter_add_rows",
            geometry::copy_geometry(n, width),
            yd,
            &rows,
            &weights,
            o,
            &w
        );
    }

    fn experts(&self, experts: &[[&CudaMat; 3]]) -> Option<CudaExperts> {
        let first = experts.first()?[0];
        let (ffn, hidden) = first.shape();
        let kind = first.kind();
        let mut tables: [Vec<u64>; 3] = Default::default();
        for mats in experts {
            for (i, m) in mats.iter().enumerate() {
                let shape = if i == 2 { (hidden, ffn) } else { (ffn, hidden) };
                if m.shape() != shape {
                    return None;
                }
                // Every expert in the format of the first (Q4_0 and Q4_1 may mix: a Q4_0
                // record's minimums are 0).
                match m {
                    CudaMat::Q8 { q, d, .. } if kind == Kind::Q8 => {
                        let e = ExpertQ8 {
                            q: self.address(q),
                            d: self.address(d),
                        };
                        tables[i].extend([e.q, e.d]);
                    }
                    CudaMat::Q4 { codes, d, m, .. } if kind == Kind::Q4 => {
                        let e = ExpertQ4 {
                            c: self.address(codes),
                            d: self.address(d),
                            m: m.as_ref().map_or(0, |m| self.address(m)),
                        };
                        tables[i].extend([e.c, e.d, e.m]);
                    }
                    _ => return None,
                }
            }
        }
        let upload = |t: &[u64]| {
            self.upload_new(t)
                .map_err(|e| self.gpu.record(format!("the experts' tables: {e}")))
                .ok()
        };
        Some(CudaExperts {
            tables: [upload(&tables[0])?, upload(&tables[1])?, upload(&tables[2])?],
            kernel: match kind {
                Kind::Q4 => "matmul_q4_experts",
                _ => "matmul_q8_experts",
            },
            ffn,
            hidden,
        })
    }

    fn routed_experts(
        &self,
        ws: &mut CudaWorkspace,
        x: &CudaBuf,
        routing: &CudaRouting,
        experts: &CudaExperts,
        scratch: [&mut CudaBuf; 3],
        out: &mut CudaBuf,
    ) -> Option<usize> {
        let [gate, up, down] = scratch;
        let (rows, top_k) = routing.shape();
        let n = rows * top_k;
        let (ffn, hidden) = (experts.ffn, experts.hidden);
        self.resize(out, x.len);
        if n == 0 {
            return Some(0);
        }
        self.resize(gate, n * ffn);
        self.resize(up, n * ffn);
        self.resize(down, n * hidden);
        let (Some(xd), Some(g), Some(u), Some(y), Some(o)) = (
            self.dev(x),
            gate.data.as_ref(),
            up.data.as_ref(),
            down.data.as_ref(),
            out.data.as_ref(),
        ) else {
            return None;
        };
        let word = |at| routing.word(self, at);
        let (Some(base), Some(weights), Some(tiles), Some(row_entries)) = (
            word(0),
            word(routing.at.weights),
            word(routing.at.tiles),
            word(routing.at.row_entries),
        ) else {
            return None;
        };
        if !self.quantize(ws, xd, x.len) {
            return None;
        }
        let tiles = (tiles, routing.tiles());
        // Gate and up read the batch rows through the entries' row table (at `base`).
        for (table, product) in [(&experts.tables[0], g), (&experts.tables[1], u)] {
            self.launch_experts(ws, (experts.kernel, table), tiles, base, product, ffn, hidden);
        }
        // SiLU·up and the down product's quantization in one launch (the MLP's width is
        // whole Q8_0 blocks, as every quantized product needs).
        if !self.silu_mul_q8(ws, g, u, n * ffn) {
            return None;
        }
        // The down product reads the gated rows entry by entry: no row table.
        self.launch_experts(ws, (experts.kernel, &experts.tables[2]), tiles, 0, y, hidden, ffn);
        let (k, w) = (top_k as i32, hidden as i32);
        launch!(
            self.gpu,
            "combine_rows",
            geometry::copy_geometry(rows, hidden),
            y,
            &row_entries,
            &weights,
            o,
            &k,
            &w
        );
        // Only the device knows how many experts a routing it made woke.
        routing.device.is_none().then_some(routing.plan.active)
    }

    fn split_qkvz(
        &self,
        qkvz: &CudaBuf,
        ba: &CudaBuf,
        shape: LinearAttnShape,
        qkv: &mut CudaBuf,
        z: &mut CudaBuf,
        b: &mut CudaBuf,
        a: &mut CudaBuf,
    ) {
        let (nk, nv, dk, dv) = (
            shape.key_heads,
            shape.value_heads,
            shape.key_head_dim,
            shape.value_head_dim,
        );
        let per_k = nv / nk.max(1);
        let group = 2 * dk + 2 * per_k * dv;
        let rows = qkvz.len / (group * nk).max(1);
        self.resize(qkv, rows * shape.channels());
        self.resize(z, rows * shape.values());
        self.resize(b, rows * nv);
        self.resize(a, rows * nv);
        let (Some(src), Some(src_ba), Some(q), Some(zd), Some(bd), Some(ad)) = (
            self.dev(qkvz),
            self.dev(ba),
            qkv.data.as_ref(),
            z.data.as_ref(),
            b.data.as_ref(),
            a.data.as_ref(),
        ) else {
            return;
        };
        let (n, n_ba) = ((rows * group * nk) as u64, (rows * 2 * nv) as u64);
        let (nk, dk, per_k, dv) = (nk as i32, dk as i32, per_k as i32, dv as i32);
        let g = geometry::elementwise_geometry(n as usize);
        launch!(self.gpu, "split_qkvz", g, src, q, zd, &n, &nk, &dk, &per_k, &dv);
        let g = geometry::elementwise_geometry(n_ba as usize);
        launch!(self.gpu, "split_ba", g, src_ba, bd, ad, &n_ba, &nk, &per_k);
    }

    fn linear_attention(
        &self,
        ws: &mut CudaWorkspace,
        layer: usize,
        qkv: &CudaBuf,
        b: &CudaBuf,
        a: &CudaBuf,
        params: [&CudaVector; 3],
        shape: LinearAttnShape,
        kv: &mut CudaBatch<'_>,
        out: &mut CudaBuf,
    ) {
        let [taps, dt_bias, a_rate] = params;
        let (nk, nv, dk, dv) = (
            shape.key_heads,
            shape.value_heads,
            shape.key_head_dim,
            shape.value_head_dim,
        );
        let channels = shape.channels();
        let rows = qkv.len / channels.max(1);
        let seqs = kv.seqs.len();
        self.resize(out, rows * shape.values());
        if rows == 0 || seqs == 0 {
            return;
        }
        self.reserve(&mut ws.conv, rows * channels);
        let pool = &*kv.pool;
        let (Some(x), Some(bd), Some(ad), Some(o), Some(conv), Some(states), Some(meta)) = (
            self.dev(qkv),
            self.dev(b),
            self.dev(a),
            out.data.as_ref(),
            ws.conv.as_ref(),
            pool.states.as_ref(),
            pool.linear.as_ref(),
        ) else {
            self.gpu
                .record("linear attention on a pool without recurrent state".into());
            return;
        };
        let (l, sl, sv) = (layer as i32, pool.state_at.layers as i32, pool.state_at.values as i32);
        let (ch, kernel) = (channels as i32, shape.conv_kernel as i32);
        launch!(
            self.gpu,
            "conv1d_silu",
            linear::conv_geometry(channels, seqs),
            x,
            conv,
            &taps.data,
            meta,
            states,
            &l,
            &sl,
            &sv,
            &ch,
            &kernel
        );
        let pieces = (rows * 2 * nk) as u64;
        let (nk32, dk32) = (nk as i32, dk as i32);
        let q_scale = 1.0 / (dk as f32).sqrt();
        launch!(
            self.gpu,
            "l2norm_heads",
            linear::l2norm_geometry(pieces as usize),
            conv,
            &pieces,
            &nk32,
            &dk32,
            &ch,
            &q_scale
        );
        let (conv_state, nv32, dv32) = (shape.conv_state() as i32, nv as i32, dv as i32);
        let tiled = i32::from(shape.value_heads_tiled);
        let geometry = linear::delta_geometry(nv, seqs, dv);
        let (dt, ar) = (&dt_bias.data, &a_rate.data);
        // Token by token up to each sequence's windows (all of a decode step's rows); then, if a
        // prompt has whole windows, those in the chunked form and the rows after them.
        let part = |name: &'static str, after: i32| {
            launch!(
                self.gpu,
                name,
                geometry,
                conv,
                bd,
                ad,
                dt,
                ar,
                o,
                meta,
                states,
                &l,
                &sl,
                &sv,
                &conv_state,
                &nk32,
                &nv32,
                &dk32,
                &dv32,
                &tiled,
                &after
            );
        };
        part("delta_rule", 0);
        if pool.linear_host.iter().any(|s| s.win1 > s.win0) {
            part("delta_rule_windows", 0);
            part("delta_rule", 1);
        }
    }

    fn store_kv(&self, layer: usize, k: &CudaBuf, v: &CudaBuf, kv: &mut CudaBatch<'_>) {
        let pool = &*kv.pool;
        let rows = k.len / pool.kv_dim.max(1);
        let (Some(kd), Some(vd), Some(slots)) = (self.dev(k), self.dev(v), pool.slots.as_ref()) else {
            return;
        };
        let Some((kp, vp)) = pool.layers.get(layer) else {
            self.gpu.record(format!("K/V layer {layer} is outside the pool"));
            return;
        };
        let Some((name, kp, vp)) = self.kv_addresses(kp, vp, "store_kv_f32", "store_kv_f16") else {
            return;
        };
        let d = pool.kv_dim as i32;
        let g = geometry::copy_geometry(rows, pool.kv_dim);
        launch!(self.gpu, name, g, kd, vd, &kp, &vp, slots, &d);
    }

    fn attention(
        &self,
        _ws: &mut CudaWorkspace,
        layer: usize,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        kv: &mut CudaBatch<'_>,
        shape: AttnShape,
        mask: AttnMask,
        _longest: usize,
        out: &mut CudaBuf,
    ) {
        self.store_kv(layer, k, v, kv);
        let width = shape.num_heads * shape.head_dim;
        let rows = q.len / width;
        self.resize(out, q.len);
        let pool = &*kv.pool;
        let (Some(qd), Some(o), Some(meta), Some(tables)) =
            (self.dev(q), out.data.as_ref(), pool.rows.as_ref(), pool.tables.as_ref())
        else {
            return;
        };
        let Some((kp, vp)) = pool.layers.get(layer) else { return };
        let (h, kvh, hd, bs) = (
            shape.num_heads as i32,
            shape.num_kv_heads as i32,
            shape.head_dim as i32,
            pool.block_size as i32,
        );
        let block = i32::from(mask == AttnMask::Block);
        let scale = 1.0f32 / (shape.head_dim as f32).sqrt();
        let g = geometry::attention_geometry(rows, shape.num_heads);
        let Some((name, kp, vp)) = self.kv_addresses(kp, vp, "attention_f32", "attention_f16") else {
            return;
        };
        launch!(
            self.gpu, name, g, qd, &kp, &vp, meta, tables, o, &h, &kvh, &hd, &bs, &block, &scale
        );
    }
}
