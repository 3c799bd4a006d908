//! Baton's CUDA kernels (the `.cu` files beside this one, compiled ahead of time by
//! `worker/build.rs`) and the host-side code that feeds them: weight layouts, launch geometry
//! and a batch's attention metadata. This host side builds and is tested without the `cuda`
//! feature and without a GPU; [`crate::ops::cuda`] launches the kernels.

use baton_shared::dtype::QK;

use baton_shared::dtype::DType;

use crate::kernels::cpu::q4::{Q4Error, ggml_q4_head};
use crate::kernels::cpu::q8::{Q8Error, ggml_blocks_per_row};
use crate::kv_cache::PagedSeq;
use crate::sampler::Sampler;

/// Activation rows one warp of `matmul_f32` / `matmul_q8` serves with each weight row it reads
/// (`TILE` in matmul.cu).
pub const MATMUL_TILE: u32 = 8;
/// Weight rows (one per warp) of one `matmul_*` thread block (`WARPS` in matmul.cu).
pub const MATMUL_WARPS: u32 = 4;
/// Warps of one attention thread block (`ATT_WARPS` in attention.cu).
pub const ATTENTION_WARPS: u32 = 8;
/// The widest attention head the kernel holds in registers (`MAX_DIMS` × 32 in attention.cu).
pub const MAX_HEAD_DIM: usize = 256;
/// Threads of an element-wise thread block.
pub const ELEMENTWISE_THREADS: u32 = 256;
/// Threads of the argmax block (a power of two; `argmax_rows` reduces pairwise).
pub const ARGMAX_THREADS: u32 = 1024;

/// Threads of a `sample_rows` block (one block per row).
pub const SAMPLE_THREADS: u32 = 1024;

/// `(grid, block)` of a CUDA launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
}

/// A matrix product of `rows_x` activation rows by `rows_w` weight rows: a block per
/// `MATMUL_WARPS` weight rows and `MATMUL_TILE` activation rows.
pub fn matmul_geometry(rows_x: usize, rows_w: usize) -> Geometry {
    Geometry {
        grid: (
            (rows_w as u32).div_ceil(MATMUL_WARPS),
            (rows_x as u32).div_ceil(MATMUL_TILE),
            1,
        ),
        block: (MATMUL_WARPS * 32, 1, 1),
    }
}

/// Warps of a `matmul_q8_mma` block, each a tile of 16 weight rows by 8 activation rows
/// (`MMA_WARPS` in matmul.cu).
pub const MMA_WARPS: u32 = 4;

/// `matmul_q8_mma` over `rows_x` activation rows by `rows_w` weight rows: tiles of 8 activation
/// rows in x (varying fastest), of `16 * MMA_WARPS` weight rows in y.
pub fn matmul_mma_geometry(rows_x: usize, rows_w: usize) -> Geometry {
    Geometry {
        grid: ((rows_x as u32).div_ceil(8), (rows_w as u32).div_ceil(16 * MMA_WARPS), 1),
        block: (MMA_WARPS * 32, 1, 1),
    }
}

/// The Q8_0 product kernels, all giving `matmul_q8`'s bits for every output (so a row's result
/// never depends on which one its batch took); `CudaOps` times them on the GPU and gives each
/// batch size the fastest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Q8Kernel {
    /// `matmul_q8`: a warp per weight row, `dp4a`, tiles of 8 activation rows.
    Dp4a,
    /// `matmul_q8_mma`: a warp per 16 weight rows by 8 activation rows, int8 `mma`.
    Mma,
    /// `matmul_q8_split32`: a block of 32 warps per 16 weight rows by 32 activation rows, the
    /// columns split over the warps.
    Split32,
    /// `matmul_q8_split16`: 16 warps per 16 weight rows by 8 activation rows.
    Split16,
}

impl Q8Kernel {
    /// Every kernel, `matmul_q8` (the reference the others must equal) first.
    pub const ALL: [Q8Kernel; 4] = [Q8Kernel::Dp4a, Q8Kernel::Mma, Q8Kernel::Split32, Q8Kernel::Split16];

    /// The kernel's name in matmul.cu.
    pub fn name(self) -> &'static str {
        match self {
            Q8Kernel::Dp4a => "matmul_q8",
            Q8Kernel::Mma => "matmul_q8_mma",
            Q8Kernel::Split32 => "matmul_q8_split32",
            Q8Kernel::Split16 => "matmul_q8_split16",
        }
    }

    /// A short name for reports and `BATON_CUDA_Q8_KERNEL`.
    pub fn label(self) -> &'static str {
        match self {
            Q8Kernel::Dp4a => "dp4a",
            Q8Kernel::Mma => "mma",
            Q8Kernel::Split32 => "split32",
            Q8Kernel::Split16 => "split16",
        }
    }

    /// The kernel a label names.
    pub fn from_label(label: &str) -> Option<Q8Kernel> {
        Self::ALL.into_iter().find(|k| k.label() == label)
    }

    /// Whether it runs on the int8 tensor cores.
    pub fn tensor_cores(self) -> bool {
        self != Q8Kernel::Dp4a
    }

    /// Its launch over `rows_x` activation rows by `rows_w` weight rows, or `None` where the
    /// grid would pass CUDA's 65,535 blocks in y (only `matmul_q8` takes any shape).
    pub fn geometry(self, rows_x: usize, rows_w: usize) -> Option<Geometry> {
        let split = |warps: u32, rows_per_block: u32| -> Option<Geometry> {
            let tiles = (rows_w as u64).div_ceil(16);
            (tiles <= 65_535).then(|| Geometry {
                grid: ((rows_x as u32).div_ceil(rows_per_block), tiles as u32, 1),
                block: (warps * 32, 1, 1),
            })
        };
        match self {
            Q8Kernel::Dp4a => Some(matmul_geometry(rows_x, rows_w)),
            Q8Kernel::Mma => {
                ((rows_w as u64).div_ceil(16 * MMA_WARPS as u64) <= 65_535).then(|| matmul_mma_geometry(rows_x, rows_w))
            }
            Q8Kernel::Split32 => split(32, 32),
            Q8Kernel::Split16 => split(16, 8),
        }
    }
}

/// How long one Q8_0 kernel took for a product of `rows` activation rows (seconds per launch).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Q8Timing {
    pub kernel: Q8Kernel,
    pub rows: usize,
    pub seconds: f64,
}

/// Which Q8_0 kernel a product takes at each batch size: `kernels[i]` from
/// [`Q8Plan::FROM_ROWS`]`[i]` activation rows up to the next entry's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Q8Plan {
    pub kernels: [Q8Kernel; 5],
}

impl Q8Plan {
    /// The batch sizes a plan is timed at: decode of one sequence, small and large decode
    /// batches, and short and long prompt chunks.
    pub const FROM_ROWS: [usize; 5] = [1, 8, 32, 256, 2048];

    /// How much faster than `matmul_q8` another kernel must time to be taken instead: timings
    /// a few percent apart are noise, and then the reference kernel stays.
    pub const MARGIN: f64 = 0.97;

    /// One kernel for every batch.
    pub fn only(kernel: Q8Kernel) -> Self {
        Self { kernels: [kernel; 5] }
    }

    /// The plan when the kernels could not be timed: `matmul_q8` for fewer than 8 rows and
    /// `matmul_q8_mma` from 8 where the tensor cores gave `matmul_q8`'s bits.
    pub fn untimed(mma: bool) -> Self {
        let batch = if mma { Q8Kernel::Mma } else { Q8Kernel::Dp4a };
        Self {
            kernels: [Q8Kernel::Dp4a, batch, batch, batch, batch],
        }
    }

    /// The fastest kernel timed at each size: among the others a tie keeps the kernel earlier
    /// in [`Q8Kernel::ALL`], and `matmul_q8` stays unless the fastest beats it by
    /// [`Q8Plan::MARGIN`]; a size with no timing takes `matmul_q8`.
    pub fn fastest(timings: &[Q8Timing]) -> Self {
        let mut kernels = [Q8Kernel::Dp4a; 5];
        for (i, &rows) in Self::FROM_ROWS.iter().enumerate() {
            let at = |k: Q8Kernel| {
                timings
                    .iter()
                    .find(|t| t.kernel == k && t.rows == rows && t.seconds.is_finite())
            };
            let mut best: Option<&Q8Timing> = None;
            for t in Q8Kernel::ALL
                .into_iter()
                .filter(|k| *k != Q8Kernel::Dp4a)
                .filter_map(at)
            {
                if best.is_none_or(|b| t.seconds < b.seconds) {
                    best = Some(t);
                }
            }
            kernels[i] = match (best, at(Q8Kernel::Dp4a)) {
                (Some(b), Some(reference)) if b.seconds < Self::MARGIN * reference.seconds => b.kernel,
                (Some(b), None) => b.kernel,
                _ => Q8Kernel::Dp4a,
            };
        }
        Self { kernels }
    }

    /// The kernel a product of `rows` activation rows by `rows_w` weight rows takes, and its
    /// launch (`matmul_q8` where the planned kernel's grid would not fit).
    pub fn launch(&self, rows: usize, rows_w: usize) -> (Q8Kernel, Geometry) {
        let i = Self::FROM_ROWS.iter().rposition(|&from| rows >= from).unwrap_or(0);
        match self.kernels[i].geometry(rows, rows_w) {
            Some(g) => (self.kernels[i], g),
            None => (Q8Kernel::Dp4a, matmul_geometry(rows, rows_w)),
        }
    }

    /// Whether any batch size runs on the tensor cores.
    pub fn tensor_cores(&self) -> bool {
        self.kernels.iter().any(|k| k.tensor_cores())
    }

    /// The plan in one word (two bits a size: its kernel's place in [`Q8Kernel::ALL`]), so
    /// clones of the operations can share it in an atomic.
    pub fn to_bits(&self) -> u32 {
        self.kernels.iter().enumerate().fold(0, |bits, (i, k)| {
            let at = Q8Kernel::ALL.iter().position(|a| a == k).unwrap_or(0) as u32;
            bits | at << (2 * i)
        })
    }

    /// The plan [`Q8Plan::to_bits`] wrote.
    pub fn from_bits(bits: u32) -> Self {
        let mut kernels = [Q8Kernel::Dp4a; 5];
        for (i, k) in kernels.iter_mut().enumerate() {
            *k = Q8Kernel::ALL[(bits >> (2 * i) & 3) as usize];
        }
        Self { kernels }
    }
}

impl std::fmt::Display for Q8Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (k, from)) in self.kernels.iter().zip(Self::FROM_ROWS).enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{} from {from} rows", k.label())?;
        }
        Ok(())
    }
}

/// Products one `matmul_*` launch computes at most (`Group` in matmul.cu).
pub const GROUP: usize = 3;

/// Up to [`GROUP`] products of the same activations for one launch, as matmul.cu's `Group`:
/// device addresses of each product's weights, scales, bias and output (0: none), and its
/// weight rows.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MatmulGroup {
    pub w: [u64; GROUP],
    pub d: [u64; GROUP],
    /// Q4_1 block minimums (f16 bits); 0 otherwise.
    pub m: [u64; GROUP],
    pub bias: [u64; GROUP],
    pub out: [u64; GROUP],
    pub rows: [i32; GROUP + 1],
}

impl MatmulGroup {
    /// Weight rows of all its products.
    pub fn total_rows(&self) -> usize {
        self.rows.iter().map(|&r| r as usize).sum()
    }
}

/// One thread per value of `n`.
pub fn elementwise_geometry(n: usize) -> Geometry {
    Geometry {
        grid: ((n as u64).div_ceil(ELEMENTWISE_THREADS as u64) as u32, 1, 1),
        block: (ELEMENTWISE_THREADS, 1, 1),
    }
}

/// One block per row, a thread per `per_thread` values of its `width` (one warp at least,
/// 1,024 threads at most): a row's loads are issued together rather than one after another
/// by a few threads, which is what made a 4,096-wide RMSNorm latency-bound.
fn row_geometry(rows: usize, width: usize, per_thread: usize) -> Geometry {
    let warps = (width.div_ceil(per_thread.max(1)) as u32).div_ceil(32).clamp(1, 32);
    Geometry {
        grid: (rows as u32, 1, 1),
        block: (warps * 32, 1, 1),
    }
}

/// RMSNorm of `rows` rows of `width`: a thread per four values (`rmsnorm` loads a float4).
pub fn norm_geometry(rows: usize, width: usize) -> Geometry {
    row_geometry(rows, width, 4)
}

/// Row copies (embedding gather, K/V stores): a thread per value.
pub fn copy_geometry(rows: usize, width: usize) -> Geometry {
    row_geometry(rows, width, 1)
}

/// `quantize_q8`: a warp per 32-value block, eight warps a block.
pub fn quantize_geometry(blocks: usize) -> Geometry {
    Geometry {
        grid: ((blocks as u64).div_ceil(8) as u32, 1, 1),
        block: (256, 1, 1),
    }
}

/// Attention: a block per (query row, head).
pub fn attention_geometry(rows: usize, heads: usize) -> Geometry {
    Geometry {
        grid: (rows as u32, heads as u32, 1),
        block: (ATTENTION_WARPS * 32, 1, 1),
    }
}

/// A block of `threads` per row: `argmax_rows` ([`ARGMAX_THREADS`]) and `sample_rows`
/// ([`SAMPLE_THREADS`]).
pub fn block_per_row(rows: usize, threads: u32) -> Geometry {
    Geometry {
        grid: (rows as u32, 1, 1),
        block: (threads, 1, 1),
    }
}

/// A Q8_0 matrix as the GPU kernels read it: row-major i8 quants (so a lane loads a whole
/// 32-byte block with two 16-byte loads) and each block's f16 scale bits, row by row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Q8Device {
    pub rows: usize,
    pub cols: usize,
    pub quants: Vec<i8>,
    pub scales: Vec<u16>,
}

impl Q8Device {
    /// Split ggml Q8_0 blocks (per block: f16 scale, 32 i8) into quants and scales. A quant of
    /// -128 (ggml never writes one) becomes -127, as on the CPU, so both paths compute with the
    /// same weights.
    pub fn from_ggml(bytes: &[u8], rows: usize, cols: usize) -> Result<Self, Q8Error> {
        let nb = ggml_blocks_per_row(bytes.len(), rows, cols)?;
        let mut quants = Vec::with_capacity(rows * cols);
        let mut scales = Vec::with_capacity(rows * nb);
        for block in bytes.chunks_exact(2 + QK) {
            scales.push(u16::from_le_bytes([block[0], block[1]]));
            quants.extend(block[2..].iter().map(|&v| (v as i8).max(-127)));
        }
        Ok(Self {
            rows,
            cols,
            quants,
            scales,
        })
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.quants.len() + 2 * self.scales.len()
    }

    /// Row `r` as f32 (quant × scale).
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let nb = self.cols / QK;
        (0..self.cols)
            .map(|c| {
                let d = half::f16::from_bits(self.scales[r * nb + c / QK]).to_f32();
                self.quants[r * self.cols + c] as f32 * d
            })
            .collect()
    }
}

/// A Q4_0 or Q4_1 matrix as the GPU kernels read it: each block's 16 code bytes as ggml packs
/// them (byte `j`: value `j` in the low nibble, value `j + 16` in the high), row-major, so a
/// lane loads a block with one 16-byte load; f16 scale bits `d`, and for Q4_1 the f16 minimum
/// bits `m` (Q4_0's minimum is `-8 d`, formed in the kernel). A weight is `code · d + m`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Q4Device {
    pub rows: usize,
    pub cols: usize,
    pub codes: Vec<u8>,
    pub scales: Vec<u16>,
    /// Empty for Q4_0.
    pub mins: Vec<u16>,
}

impl Q4Device {
    /// Split ggml Q4_0 / Q4_1 blocks into codes, scales and minimums.
    pub fn from_ggml(dtype: DType, bytes: &[u8], rows: usize, cols: usize) -> Result<Self, Q4Error> {
        let head = ggml_q4_head(dtype, bytes.len(), rows, cols)?;
        let blocks = rows * cols / QK;
        let mut codes = Vec::with_capacity(rows * cols / 2);
        let mut scales = Vec::with_capacity(blocks);
        let mut mins = Vec::with_capacity(if head == 4 { blocks } else { 0 });
        for block in bytes.chunks_exact(head + QK / 2) {
            scales.push(u16::from_le_bytes([block[0], block[1]]));
            if head == 4 {
                mins.push(u16::from_le_bytes([block[2], block[3]]));
            }
            codes.extend_from_slice(&block[head..]);
        }
        Ok(Self {
            rows,
            cols,
            codes,
            scales,
            mins,
        })
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.codes.len() + 2 * (self.scales.len() + self.mins.len())
    }

    /// Row `r` as f32 (`code · d + m`).
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let nb = self.cols / QK;
        let f = |bits: u16| half::f16::from_bits(bits).to_f32();
        (0..self.cols)
            .map(|c| {
                let b = r * nb + c / QK;
                let byte = self.codes[r * self.cols / 2 + (c / QK) * (QK / 2) + c % (QK / 2)];
                let code = if c % QK < QK / 2 { byte & 0x0f } else { byte >> 4 };
                let d = f(self.scales[b]);
                let m = if self.mins.is_empty() {
                    -8.0 * d
                } else {
                    f(self.mins[b])
                };
                code as f32 * d + m
            })
            .collect()
    }
}

/// What the attention kernels need to know about a batch, uploaded once per forward and read
/// by every layer: per query row `{position, causal end, block end, table offset}`, the storage
/// row each new K/V row goes to, and the sequences' block tables back to back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchMeta {
    pub rows: Vec<i32>,
    pub slots: Vec<i32>,
    pub tables: Vec<u32>,
}

/// Values per row of [`BatchMeta::rows`].
pub const META_WIDTH: usize = 4;

impl BatchMeta {
    /// The metadata of `seqs` over blocks of `block_size` positions (rebuilt in place, so
    /// steady serving allocates nothing). The tables must already have been checked to cover
    /// every position.
    pub fn build(&mut self, seqs: &[PagedSeq<'_>], block_size: usize) {
        self.rows.clear();
        self.slots.clear();
        self.tables.clear();
        for s in seqs {
            let end = s.pos0 + s.len;
            let offset = self.tables.len() as i32;
            self.tables.extend_from_slice(&s.table[..end.div_ceil(block_size)]);
            for p in s.pos0..end {
                self.rows
                    .extend_from_slice(&[p as i32, p as i32 + 1, end as i32, offset]);
                let row = s.table[p / block_size] as usize * block_size + p % block_size;
                self.slots.push(row as i32);
            }
        }
    }
}

/// The kernels compiled into this build: one module per `.cu` file, a cubin per GPU
/// generation and the PTX for newer ones.
#[cfg(feature = "cuda")]
pub mod embedded {
    /// One `.cu` file, compiled.
    #[derive(Debug)]
    pub struct KernelModule {
        pub name: &'static str,
        pub ptx: &'static str,
        /// `(sm, cubin)`: `sm` is the compute capability as `10 × major + minor`.
        pub cubins: &'static [(u32, &'static [u8])],
    }

    include!(concat!(env!("OUT_DIR"), "/cuda_kernels.rs"));

    impl KernelModule {
        /// The cubin a GPU of compute capability `sm` runs: its own, else the newest of its
        /// major version below it (cubins run on later minors of the same major); `None`: use
        /// the PTX.
        pub fn cubin_for(&self, sm: u32) -> Option<&'static [u8]> {
            self.cubins
                .iter()
                .filter(|(arch, _)| *arch / 10 == sm / 10 && *arch <= sm)
                .max_by_key(|(arch, _)| *arch)
                .map(|(_, bytes)| *bytes)
        }
    }
}

/// One row's sampling settings and draw, as `sample_rows` (sampling.cu) reads them.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRow {
    /// Greater than 0 (a greedy row is top-k 1 at temperature 1).
    pub temperature: f32,
    /// 0: no limit.
    pub top_k: i32,
    /// 1: no limit.
    pub top_p: f32,
    /// 0: no limit.
    pub min_p: f32,
    /// The row's uniform draw in [0, 1); 0 for a greedy row, which draws nothing.
    pub u: f32,
}

impl SampleRow {
    /// The most likely token (the lowest id on ties), as `argmax`.
    pub const GREEDY: Self = Self {
        temperature: 1.0,
        top_k: 1,
        top_p: 1.0,
        min_p: 0.0,
        u: 0.0,
    };

    /// The next row of `sampler`'s sequence: its settings, and one draw from its stream unless
    /// it is greedy (as the CPU path draws).
    pub fn next(sampler: &mut Sampler) -> Self {
        if sampler.is_greedy() {
            return Self::GREEDY;
        }
        let p = sampler.params();
        let (temperature, top_k, top_p, min_p) = (p.temperature, p.top_k, p.top_p, p.min_p);
        Self {
            temperature,
            top_k: i32::try_from(top_k).unwrap_or(0),
            top_p,
            min_p,
            u: sampler.draw(),
        }
    }
}

/// A weight of 1 (the most likely token's) in `sample_rows`' integer units.
const MASS_ONE: f32 = (1u64 << 40) as f32;

/// A logit's bits in the order of the values, NaN lowest (`order_key` in sampling.cu).
fn order_key(l: f32) -> u32 {
    if l.is_nan() {
        return 0;
    }
    let b = l.to_bits();
    if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 }
}

/// What `sample_rows` picks for one row of logits, computed the plain way: rank every token,
/// cut, and walk the kept ones in id order. The kernel must give the same id wherever its
/// `exp` gives the same bits as this one (the CPU emulation's does; a GPU's may differ by an
/// ulp, which moves a weight by one unit in 2^40 and a draw's token only at a boundary).
pub fn sample_row_reference(logits: &[f32], s: &SampleRow) -> u32 {
    let n = logits.len();
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) / s.temperature;
    let w = |i: usize| (logits[i] / s.temperature - m).exp();
    let mass = |i: usize| {
        let w = w(i);
        if w > 0.0 { (w * MASS_ONE) as u64 } else { 0 }
    };
    let mut ranked: Vec<usize> = (0..n).collect();
    ranked.sort_by(|&a, &b| order_key(logits[b]).cmp(&order_key(logits[a])).then(a.cmp(&b)));
    if s.top_k > 0 && (s.top_k as usize) < n {
        ranked.truncate(s.top_k as usize);
    }
    if s.top_p < 1.0 {
        let total: u64 = ranked.iter().map(|&i| mass(i)).sum();
        let want = ((f64::from(s.top_p) * total as f64) as u64).max(1);
        let mut before = 0;
        let keep = ranked
            .iter()
            .take_while(|&&i| {
                let inside = before < want;
                before += mass(i);
                inside
            })
            .count();
        ranked.truncate(keep);
    }
    let mut kept = vec![false; n];
    for &i in &ranked {
        kept[i] = w(i) >= s.min_p;
    }
    let total: u64 = (0..n).filter(|&i| kept[i]).map(mass).sum();
    if total == 0 {
        return (0..n).find(|&i| kept[i]).unwrap_or(0) as u32;
    }
    let r = ((f64::from(s.u) * total as f64) as u64).min(total - 1);
    let mut acc = 0;
    for i in (0..n).filter(|&i| kept[i]) {
        acc += mass(i);
        if r < acc {
            return i as u32;
        }
    }
    unreachable!("the draw falls below the total")
}

pub mod experts;
pub mod linear;

#[cfg(test)]
mod emulated;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::q8::Q8Matrix;

    #[test]
    fn a_q8_plan_gives_each_batch_size_the_fastest_kernel_timed() {
        let t = |kernel, rows, seconds| Q8Timing { kernel, rows, seconds };
        let timings = [
            t(Q8Kernel::Dp4a, 1, 2.0),
            t(Q8Kernel::Split32, 1, 1.5),
            t(Q8Kernel::Mma, 1, f64::NAN),
            t(Q8Kernel::Dp4a, 8, 3.0),
            t(Q8Kernel::Mma, 8, 2.0),
            t(Q8Kernel::Split16, 8, 2.0),
            t(Q8Kernel::Dp4a, 32, 9.0),
            t(Q8Kernel::Split16, 32, 4.0),
            t(Q8Kernel::Split32, 32, 3.0),
            // Within the margin of matmul_q8: it stays.
            t(Q8Kernel::Dp4a, 2048, 1.0),
            t(Q8Kernel::Split32, 2048, 0.98),
        ];
        let plan = Q8Plan::fastest(&timings);
        // 8 rows: a tie keeps the earlier kernel; 256: not timed, so matmul_q8.
        assert_eq!(
            plan.kernels,
            [
                Q8Kernel::Split32,
                Q8Kernel::Mma,
                Q8Kernel::Split32,
                Q8Kernel::Dp4a,
                Q8Kernel::Dp4a
            ]
        );
        assert_eq!(
            plan.to_string(),
            "split32 from 1 rows, mma from 8 rows, split32 from 32 rows, dp4a from 256 rows, dp4a from 2048 rows"
        );
        assert!(plan.tensor_cores());
        assert!(!Q8Plan::untimed(false).tensor_cores());
        assert_eq!(Q8Plan::untimed(true).launch(7, 64).0, Q8Kernel::Dp4a);
        assert_eq!(Q8Plan::untimed(true).launch(8, 64).0, Q8Kernel::Mma);
        // Each size takes the entry of the largest timed size not above it.
        let launch = |rows| plan.launch(rows, 4096).0;
        assert_eq!(
            [
                launch(1),
                launch(7),
                launch(8),
                launch(31),
                launch(32),
                launch(255),
                launch(256),
                launch(4096)
            ],
            [
                Q8Kernel::Split32,
                Q8Kernel::Split32,
                Q8Kernel::Mma,
                Q8Kernel::Mma,
                Q8Kernel::Split32,
                Q8Kernel::Split32,
                Q8Kernel::Dp4a,
                Q8Kernel::Dp4a
            ]
        );
        // Without a matmul_q8 timing the fastest other kernel is taken.
        let alone = Q8Plan::fastest(&[t(Q8Kernel::Split16, 1, 5.0), t(Q8Kernel::Mma, 1, 6.0)]);
        assert_eq!(alone.kernels[0], Q8Kernel::Split16);
        let mixed = Q8Plan {
            kernels: [
                Q8Kernel::Dp4a,
                Q8Kernel::Mma,
                Q8Kernel::Split16,
                Q8Kernel::Split32,
                Q8Kernel::Mma,
            ],
        };
        assert_eq!(Q8Plan::from_bits(mixed.to_bits()), mixed);
        assert_eq!(mixed.launch(2047, 64).0, Q8Kernel::Split32);
        assert_eq!(mixed.launch(2048, 64).0, Q8Kernel::Mma);
        // A split kernel's grid holds 65,535 tiles of 16 weight rows in y; past that matmul_q8.
        let only = Q8Plan::only(Q8Kernel::Split16);
        assert_eq!(only.launch(3, 16 * 65_535).0, Q8Kernel::Split16);
        assert_eq!(
            only.launch(3, 16 * 65_535 + 1),
            (Q8Kernel::Dp4a, matmul_geometry(3, 16 * 65_535 + 1))
        );
        for k in Q8Kernel::ALL {
            assert_eq!(Q8Kernel::from_label(k.label()), Some(k));
            assert_eq!(Q8Plan::from_bits(Q8Plan::only(k).to_bits()), Q8Plan::only(k));
        }
        assert_eq!(Q8Plan::from_bits(plan.to_bits()), plan);
        assert_eq!(Q8Plan::only(Q8Kernel::Dp4a).to_bits(), 0);
        assert_eq!(Q8Kernel::from_label("cublas"), None);
    }

    #[test]
    fn split_kernels_cover_every_row_with_whole_blocks() {
        // Blocks of 32 warps × 32 activation rows and 16 warps × 8, 16 weight rows each, as
        // matmul.cu instantiates q8_split.
        let matmul = include_str!("matmul.cu");
        assert!(matmul.contains("__launch_bounds__(32 * 32, 1)\nmatmul_q8_split32"));
        assert!(matmul.contains("q8_split<32, 4, 2>(xq"));
        assert!(matmul.contains("__launch_bounds__(16 * 32, 2)\nmatmul_q8_split16"));
        assert!(matmul.contains("q8_split<16, 1, 3>(xq"));
        for (k, warps, rows_per_block) in [(Q8Kernel::Split32, 32, 32), (Q8Kernel::Split16, 16, 8)] {
            for (rows_x, rows_w) in [(1usize, 16usize), (33, 17), (256, 4096)] {
                let g = k.geometry(rows_x, rows_w).expect("a small grid");
                assert_eq!(g.block, (warps * 32, 1, 1));
                assert!(g.grid.0 as usize * rows_per_block >= rows_x);
                assert!((g.grid.0 as usize - 1) * rows_per_block < rows_x);
                assert!(g.grid.1 as usize * 16 >= rows_w && (g.grid.1 as usize - 1) * 16 < rows_w);
            }
        }
    }

    /// The constants above are the kernels' own `#define`s.
    #[test]
    fn geometry_constants_match_the_kernel_sources() {
        let matmul = include_str!("matmul.cu");
        let attention = include_str!("attention.cu");
        assert!(matmul.contains(&format!("#define TILE {MATMUL_TILE}\n")));
        assert!(matmul.contains(&format!("#define WARPS {MATMUL_WARPS}\n")));
        assert!(matmul.contains(&format!("#define MMA_WARPS {MMA_WARPS}\n")));
        // The group's layout: four arrays of GROUP addresses, then GROUP + 1 row counts.
        assert!(
            matmul.contains("    u64 w[3];") && matmul.contains("    u64 m[3];") && matmul.contains("    int rows[4];")
        );
        assert_eq!(GROUP, 3);
        assert_eq!(size_of::<MatmulGroup>(), 5 * 3 * 8 + 4 * 4);
        assert!(attention.contains(&format!("#define ATT_WARPS {ATTENTION_WARPS}\n")));
        assert!(attention.contains(&format!("#define MAX_DIMS {} ", MAX_HEAD_DIM / 32)));
        let elementwise = include_str!("elementwise.cu");
        assert!(elementwise.contains(&format!("best_v[{ARGMAX_THREADS}]")));
    }

    #[test]
    fn launch_geometry_covers_every_output_once() {
        for (rows_x, rows_w) in [(1, 1), (1, 576), (7, 1536), (8, 8), (9, 49152), (2048, 4096)] {
            let g = matmul_geometry(rows_x, rows_w);
            assert!(g.grid.0 * MATMUL_WARPS >= rows_w as u32 && (g.grid.0 - 1) * MATMUL_WARPS < rows_w as u32);
            assert!(g.grid.1 * MATMUL_TILE >= rows_x as u32 && (g.grid.1 - 1) * MATMUL_TILE < rows_x as u32);
            assert!(g.grid.1 <= 65_535, "grid.y limit");
            // matmul_q8_mma: activation tiles of 8 in x, weight tiles of 64 in y.
            let g = matmul_mma_geometry(rows_x, rows_w);
            assert!(g.grid.0 * 8 >= rows_x as u32 && (g.grid.0 - 1) * 8 < rows_x as u32);
            let w = 16 * MMA_WARPS;
            assert!(g.grid.1 * w >= rows_w as u32 && (g.grid.1 - 1) * w < rows_w as u32);
        }
        let g = elementwise_geometry(1_000_001);
        assert_eq!(g.grid.0 as u64 * g.block.0 as u64, 1_000_192);
        assert_eq!(quantize_geometry(17).grid.0, 3);
        assert_eq!(attention_geometry(5, 9).grid, (5, 9, 1));
        // Row kernels: a block per row, whole warps, at most 1,024 threads.
        assert_eq!(norm_geometry(3, 4096).grid, (3, 1, 1));
        assert_eq!(norm_geometry(3, 4096).block, (1024, 1, 1));
        assert_eq!(norm_geometry(1, 576).block, (160, 1, 1));
        assert_eq!(norm_geometry(7, 16).block, (32, 1, 1));
        assert_eq!(norm_geometry(1, 8192).block, (1024, 1, 1));
        assert_eq!(copy_geometry(2, 1024).block, (1024, 1, 1));
        assert_eq!(copy_geometry(2, 192).block, (192, 1, 1));
    }

    #[test]
    fn q8_layout_holds_the_cpu_matrix_weights() {
        let (rows, cols) = (5, 64);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let mut bytes = baton_shared::dtype::quantize_q8_0(&w);
        // A -128 quant (never written by ggml) is read as -127 by both paths.
        bytes[2] = 0x80;
        let gpu = Q8Device::from_ggml(&bytes, rows, cols).unwrap();
        let cpu = Q8Matrix::from_ggml(&bytes, rows, cols).unwrap();
        let mut want = vec![0f32; cols];
        for r in 0..rows {
            cpu.dequantize_row(r, &mut want);
            assert_eq!(gpu.dequantize_row(r), want, "row {r}");
        }
        assert_eq!(gpu.bytes(), rows * cols + 2 * rows * cols / QK);
        assert_eq!(
            Q8Device::from_ggml(&bytes[1..], rows, cols),
            Err(Q8Error::Bytes {
                got: bytes.len() - 1,
                want: bytes.len(),
                rows,
                cols
            })
        );
        assert_eq!(Q8Device::from_ggml(&[], 1, 33), Err(Q8Error::RowLength(33)));
    }

    #[test]
    fn q4_layout_holds_the_cpu_matrix_weights() {
        use crate::kernels::cpu::q4::Q4Matrix;
        let (rows, cols) = (3, 96);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.021)
            .collect();
        for (dtype, bytes) in [
            (DType::Q4_0, baton_shared::dtype::quantize_q4_0(&w)),
            (DType::Q4_1, baton_shared::dtype::quantize_q4_1(&w)),
        ] {
            let gpu = Q4Device::from_ggml(dtype, &bytes, rows, cols).unwrap();
            let cpu = Q4Matrix::from_ggml(dtype, &bytes, rows, cols).unwrap();
            let mut want = vec![0f32; cols];
            for r in 0..rows {
                cpu.dequantize_row(r, &mut want);
                assert_eq!(gpu.dequantize_row(r), want, "{dtype} row {r}");
            }
            let head = if dtype == DType::Q4_1 { 4 } else { 2 };
            assert_eq!(
                gpu.bytes(),
                bytes.len(),
                "{dtype}: {head}-byte heads and 16 code bytes per block"
            );
            assert!(Q4Device::from_ggml(dtype, &bytes[1..], rows, cols).is_err());
        }
        assert!(Q4Device::from_ggml(DType::Q8_0, &[], 1, 32).is_err());
    }

    #[test]
    fn batch_meta_names_each_rows_keys_and_storage() {
        let (a, b) = ([3u32, 1, 7], [0u32, 5]);
        let seqs = [
            PagedSeq {
                pos0: 6,
                len: 3,
                stored: 6,
                table: &a,
                state_slot: 0,
                prompt_len: 0,
            },
            PagedSeq {
                pos0: 0,
                len: 2,
                stored: 0,
                table: &b,
                state_slot: 1,
                prompt_len: 0,
            },
        ];
        let mut meta = BatchMeta::default();
        meta.build(&seqs, 4);
        // Positions 6..9 of the first sequence need blocks 0..3 of its table; the second
        // sequence needs one block.
        assert_eq!(meta.tables, vec![3, 1, 7, 0]);
        assert_eq!(
            meta.rows,
            vec![6, 7, 9, 0, 7, 8, 9, 0, 8, 9, 9, 0, 0, 1, 2, 3, 1, 2, 2, 3]
        );
        // Position 6 is block 1 (id 1) offset 2; 7 → id 1 offset 3; 8 → id 7 offset 0.
        assert_eq!(meta.slots, vec![6, 7, 28, 0, 1]);
    }

    /// The device sampler's contract keeps what the CPU sampler keeps, with the same odds:
    /// 20,000 evenly spread draws through the reference against 20,000 seeded CPU samples.
    #[test]
    fn the_device_sampling_reference_draws_as_the_cpu_sampler() {
        use baton_shared::sampling::SamplingParams;
        let vocab = 200;
        let mut rng = crate::sampler::Rng::new(9);
        let logits: Vec<f32> = (0..vocab).map(|_| rng.next_f64() as f32 * 4.0 - 2.0).collect();
        let draws = 20_000;
        for (top_k, top_p, min_p, temperature) in [
            (10, 1.0, 0.0, 1.0),
            (0, 0.5, 0.0, 1.0),
            (0, 1.0, 0.3, 0.8),
            (40, 0.7, 0.1, 1.5),
        ] {
            let params = SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                ..Default::default()
            };
            let mut cpu = vec![0usize; vocab];
            let mut device = vec![0usize; vocab];
            for i in 0..draws {
                let mut sampler = Sampler::new(&SamplingParams {
                    seed: Some(i as u64),
                    ..params.clone()
                });
                cpu[sampler.sample(&logits) as usize] += 1;
                let row = SampleRow {
                    temperature,
                    top_k: top_k as i32,
                    top_p,
                    min_p,
                    u: (i as f32 + 0.5) / draws as f32,
                };
                device[sample_row_reference(&logits, &row) as usize] += 1;
            }
            let kept = |counts: &[usize]| (0..vocab).filter(|&i| counts[i] > 0).collect::<Vec<_>>();
            assert_eq!(
                kept(&device),
                kept(&cpu),
                "kept tokens, top-k {top_k} top-p {top_p} min-p {min_p}"
            );
            for i in 0..vocab {
                let (a, b) = (cpu[i] as f64 / draws as f64, device[i] as f64 / draws as f64);
                assert!((a - b).abs() < 0.015, "token {i}: CPU {a:.4}, device reference {b:.4}");
            }
        }
    }

    #[test]
    fn a_device_sample_row_takes_the_draw_the_cpu_would() {
        use baton_shared::sampling::SamplingParams;
        let mut greedy = Sampler::new(&SamplingParams {
            temperature: 0.0,
            seed: Some(1),
            ..Default::default()
        });
        let before = greedy.clone().draw();
        assert_eq!(SampleRow::next(&mut greedy), SampleRow::GREEDY);
        assert_eq!(greedy.draw(), before, "a greedy row draws nothing");
        let params = SamplingParams {
            temperature: 0.9,
            top_k: 7,
            top_p: 0.8,
            min_p: 0.05,
            seed: Some(5),
            ..Default::default()
        };
        let mut sampler = Sampler::new(&params);
        let mut twin = sampler.clone();
        let row = SampleRow::next(&mut sampler);
        assert_eq!((row.temperature, row.top_k, row.top_p, row.min_p), (0.9, 7, 0.8, 0.05));
        assert_eq!(row.u, twin.draw());
        assert_eq!(sampler.draw(), twin.draw(), "exactly one draw per row");
        // The settings' layout is sampling.cu's: five 4-byte fields.
        assert_eq!(size_of::<SampleRow>(), 20);
        assert!(include_str!("sampling.cu").contains(&format!("#define SAMPLE_THREADS {SAMPLE_THREADS}\n")));
    }
}
