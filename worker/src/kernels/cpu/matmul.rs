//! Weight matrices in a chosen format and the threaded matrix product over them.
//!
//! Work is split into fixed chunks of `CHUNK_ROWS` output rows; each output element is computed
//! by the same code whichever thread claims its chunk, so results do not depend on the thread
//! count.

use super::dispatch::{KernelPath, Kernels};
use super::half::{self, HalfKind, HalfMatrix};
use super::q4::{self, Q4Matrix};
use super::q8::{PANEL, Q8Error, Q8Matrix, QuantizedRows};
use super::q8_gemm;
use super::{f32 as kf32, reference};
use crate::threads::{SharedMut, ThreadPool};
use baton_shared::dtype::DType;

/// Output rows per task: small enough to balance 576-row matrices over a few threads, large
/// enough that claiming a task costs nothing next to it; one Q8_0 panel.
pub const CHUNK_ROWS: usize = PANEL;

/// How a stage stores its linear-layer and head weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// f32, bit-identical to the reference path.
    #[default]
    F32,
    /// ggml Q8_0 (32-value blocks), re-quantized at load from whatever the file holds.
    Q8_0,
    /// bfloat16, rounded at load.
    Bf16,
    /// IEEE half precision, rounded at load (matrices with values past ±65504 stay f32).
    F16,
    /// ggml Q4_0 (32 4-bit codes, one scale), re-quantized at load.
    Q4_0,
    /// ggml Q4_1 (32 4-bit codes, scale and minimum), re-quantized at load.
    Q4_1,
    /// Each tensor as the file stores it: Q8_0, Q4_0, Q4_1, bf16 and f16 kept as they are (no
    /// second rounding), anything else as f32.
    Native,
}

impl WeightFormat {
    /// The 16-bit float this format holds weights in, if it is one.
    pub fn half_kind(self) -> Option<HalfKind> {
        match self {
            Self::Bf16 => Some(HalfKind::Bf16),
            Self::F16 => Some(HalfKind::F16),
            _ => None,
        }
    }

    /// The name used on command lines.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Q8_0 => "q8_0",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Native => "native",
        }
    }
}

/// Errors naming a weight format.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown weight format {0:?} (expected auto, f32, bf16, f16, q8_0, q4_0, q4_1 or native)")]
pub struct UnknownFormat(pub String);

impl std::str::FromStr for WeightFormat {
    type Err = UnknownFormat;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(Self::F32),
            "q8_0" | "q8" => Ok(Self::Q8_0),
            "bf16" => Ok(Self::Bf16),
            "f16" => Ok(Self::F16),
            "q4_0" => Ok(Self::Q4_0),
            "q4_1" => Ok(Self::Q4_1),
            "native" => Ok(Self::Native),
            _ => Err(UnknownFormat(s.to_string())),
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A row-major `[rows × cols]` weight matrix.
#[derive(Debug, Clone, PartialEq)]
pub enum Matrix {
    F32 { data: Vec<f32>, cols: usize },
    Q8_0(Q8Matrix),
    Q4(Q4Matrix),
    Half(HalfMatrix),
}

/// A borrowed weight matrix (a tied f32 head borrows the embedding table).
#[derive(Debug, Clone, Copy)]
pub enum MatRef<'a> {
    F32 { data: &'a [f32], cols: usize },
    Q8_0(&'a Q8Matrix),
    Q4(&'a Q4Matrix),
    Half(&'a HalfMatrix),
}

impl Matrix {
    /// Convert f32 weights to `format`. Block formats need `cols` to be a multiple of 32; other
    /// shapes stay f32 (correct, just not compressed). `Native` stays f32: the loader keeps a
    /// file's block formats through [`Matrix::from_ggml`] instead.
    pub fn from_f32(data: Vec<f32>, cols: usize, format: WeightFormat) -> Self {
        assert!(cols > 0 && data.len().is_multiple_of(cols), "Matrix::from_f32: shape");
        let rows = data.len() / cols;
        let q4 = |dtype| match Q4Matrix::quantize(&data, rows, cols, dtype) {
            Ok(m) => Some(Self::Q4(m)),
            Err(_) => None,
        };
        let converted = match format {
            WeightFormat::Q8_0 => match Q8Matrix::quantize(&data, rows, cols) {
                Ok(m) => Some(Self::Q8_0(m)),
                Err(Q8Error::RowLength(_) | Q8Error::Bytes { .. }) => None,
            },
            WeightFormat::Bf16 | WeightFormat::F16 => format
                .half_kind()
                .filter(|kind| kind.holds(&data))
                .map(|kind| Self::Half(HalfMatrix::from_f32(&data, cols, kind))),
            WeightFormat::Q4_0 => q4(DType::Q4_0),
            WeightFormat::Q4_1 => q4(DType::Q4_1),
            WeightFormat::F32 | WeightFormat::Native => None,
        };
        converted.unwrap_or(Self::F32 { data, cols })
    }

    /// A matrix straight from a file's ggml block bytes (Q8_0, Q4_0 or Q4_1), or `None` for
    /// any other type.
    pub fn from_ggml(dtype: DType, bytes: &[u8], rows: usize, cols: usize) -> Option<Result<Self, String>> {
        Some(match dtype {
            DType::Q8_0 => Q8Matrix::from_ggml(bytes, rows, cols)
                .map(Self::Q8_0)
                .map_err(|e| e.to_string()),
            DType::Q4_0 | DType::Q4_1 => Q4Matrix::from_ggml(dtype, bytes, rows, cols)
                .map(Self::Q4)
                .map_err(|e| e.to_string()),
            _ => return None,
        })
    }

    /// A borrowed view.
    pub fn view(&self) -> MatRef<'_> {
        match self {
            Self::F32 { data, cols } => MatRef::F32 { data, cols: *cols },
            Self::Q8_0(m) => MatRef::Q8_0(m),
            Self::Q4(m) => MatRef::Q4(m),
            Self::Half(m) => MatRef::Half(m),
        }
    }

    /// Bytes of weight data held.
    pub fn bytes(&self) -> usize {
        match self {
            Self::F32 { data, .. } => 4 * data.len(),
            Self::Q8_0(m) => m.bytes(),
            Self::Q4(m) => m.bytes(),
            Self::Half(m) => 2 * m.data.len(),
        }
    }

    /// The f32 data, if stored as f32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            Self::F32 { data, .. } => Some(data),
            Self::Q8_0(_) | Self::Q4(_) | Self::Half(_) => None,
        }
    }
}

impl MatRef<'_> {
    /// Input width.
    pub fn cols(&self) -> usize {
        match self {
            Self::F32 { cols, .. } => *cols,
            Self::Q8_0(m) => m.cols,
            Self::Q4(m) => m.cols,
            Self::Half(m) => m.cols,
        }
    }

    /// Output width.
    pub fn rows(&self) -> usize {
        match self {
            Self::F32 { data, cols } => data.len() / cols,
            Self::Q8_0(m) => m.rows,
            Self::Q4(m) => m.rows,
            Self::Half(m) => m.rows,
        }
    }
}

/// One product of a [`matmul_many`] job: weights, optional bias, output.
pub type Product<'a, 'b> = (MatRef<'a>, Option<&'b [f32]>, &'b mut [f32]);

/// `out[t][r] = x[t] · w[r] (+ bias[r])` for every `cols`-wide row of `x`, like
/// [`reference::matmul_t`], on kernel path `k` across `pool`. `xq` holds quantized activations
/// for Q8_0 weights (reused between calls).
pub fn matmul(
    k: Kernels,
    pool: &ThreadPool,
    x: &[f32],
    w: MatRef<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    xq: &mut QuantizedRows,
) {
    matmul_many(k, pool, x, [(w, bias, out)], xq);
}

/// Several products of the same input `x` (q/k/v, gate/up) as one job: one hand-off to the
/// pool instead of `N`, and `x` quantized once. Each result equals its own [`matmul`].
pub fn matmul_many<const N: usize>(
    k: Kernels,
    pool: &ThreadPool,
    x: &[f32],
    products: [Product<'_, '_>; N],
    xq: &mut QuantizedRows,
) {
    if N == 0 {
        return;
    }
    let cols = products[0].0.cols();
    let t = x.len() / cols;
    assert_eq!(x.len(), t * cols, "matmul: x is not a whole number of rows");
    let mut quantized = false;
    for (w, bias, out) in &products {
        assert_eq!(w.cols(), cols, "matmul_many: products must share the input width");
        assert_eq!(out.len(), t * w.rows(), "matmul: output size");
        if let Some(b) = bias {
            assert_eq!(b.len(), w.rows(), "matmul: bias size");
        }
        if matches!(w, MatRef::Q8_0(_) | MatRef::Q4(_)) && !quantized {
            xq.quantize_on(pool, x, cols);
            quantized = true;
        }
    }
    let xq = &*xq;
    let chunks = products.each_ref().map(|p| p.0.rows().div_ceil(CHUNK_ROWS));
    let jobs = products.map(|(w, bias, out)| (w, bias, SharedMut::new(out)));
    pool.run(chunks.iter().sum(), &|task| {
        // Task numbers run through the products' chunks in order.
        let (mut p, mut chunk) = (0, task);
        while chunk >= chunks[p] {
            chunk -= chunks[p];
            p += 1;
        }
        let (w, bias, ref shared) = jobs[p];
        let rows = w.rows();
        let r0 = chunk * CHUNK_ROWS;
        let n = CHUNK_ROWS.min(rows - r0);
        if let MatRef::Q8_0(m) = w {
            // SAFETY: this task alone writes rows r0..r0+n (panel `chunk`) of every output row.
            unsafe { q8_panel_into(k, m, xq, chunk, t, shared) };
            add_bias(bias, r0, n, t, rows, shared);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if let MatRef::Q4(m) = w
            && k.path() != KernelPath::Scalar
        {
            // SAFETY: the path is supported (a `Kernels` exists for it); this task alone writes
            // rows r0..r0+n of every output row of product p.
            unsafe { chunk_tiles(k, m, xq, r0, n, t, shared) };
            add_bias(bias, r0, n, t, rows, shared);
            return;
        }
        for i in 0..t {
            // SAFETY: this task alone writes rows r0..r0+n of each output row of product p.
            let o = unsafe { shared.slice(i * rows + r0, n) };
            match w {
                MatRef::F32 { data, cols } => {
                    let xr = &x[i * cols..(i + 1) * cols];
                    for (j, oj) in o.iter_mut().enumerate() {
                        let r = r0 + j;
                        *oj = kf32::dot(k, xr, &data[r * cols..(r + 1) * cols]);
                    }
                }
                MatRef::Q8_0(_) => unreachable!("Q8_0 runs panel by panel above"),
                MatRef::Half(m) => {
                    let xr = &x[i * m.cols..(i + 1) * m.cols];
                    for (j, oj) in o.iter_mut().enumerate() {
                        *oj = half::dot(k, m.kind, xr, m.row(r0 + j));
                    }
                }
                MatRef::Q4(m) => {
                    let a = xq.row_with_sums(i);
                    for (j, oj) in o.iter_mut().enumerate() {
                        *oj = q4::dot(k, m.row(r0 + j), a);
                    }
                }
            }
            if let Some(b) = bias {
                o.iter_mut().zip(&b[r0..r0 + n]).for_each(|(v, b)| *v += b);
            }
        }
    });
}

/// Add `bias[r0..r0+n]` to rows `r0..r0+n` of each of the `t` output rows.
fn add_bias(bias: Option<&[f32]>, r0: usize, n: usize, t: usize, rows: usize, out: &SharedMut<f32>) {
    if let Some(b) = bias {
        for i in 0..t {
            // SAFETY: the caller's task alone writes rows r0..r0+n of every output row.
            let o = unsafe { out.slice(i * rows + r0, n) };
            o.iter_mut().zip(&b[r0..r0 + n]).for_each(|(v, b)| *v += b);
        }
    }
}

/// Tokens per Q8_0 panel-kernel call: the AVX-512 VNNI kernel's 3 vectors per token fit 8
/// tokens in its 32 registers; the 256-bit kernels keep 4 per token in 16.
fn q8_tokens(k: Kernels) -> usize {
    match k.path() {
        KernelPath::Avx512Vnni => 8,
        KernelPath::Avx2 | KernelPath::AvxVnni | KernelPath::Avx512 => 2,
        KernelPath::Scalar => 1,
    }
}

/// Panel `p` of `m` against all `t` activation rows of `xq`, written into `out` (`t × rows`).
///
/// # Safety
/// No other thread may touch rows `16p..16p+16` of `out`.
unsafe fn q8_panel_into(k: Kernels, m: &Q8Matrix, xq: &QuantizedRows, p: usize, t: usize, out: &SharedMut<f32>) {
    let (r0, n) = (p * PANEL, PANEL.min(m.rows - p * PANEL));
    let group = q8_tokens(k);
    let mut tok = 0;
    while tok < t {
        let tn = group.min(t - tok);
        // SAFETY: forwarded from the caller.
        unsafe {
            match tn {
                8 => q8_group::<8>(k, m, xq, p, tok, r0, n, out),
                7 => q8_group::<7>(k, m, xq, p, tok, r0, n, out),
                6 => q8_group::<6>(k, m, xq, p, tok, r0, n, out),
                5 => q8_group::<5>(k, m, xq, p, tok, r0, n, out),
                4 => q8_group::<4>(k, m, xq, p, tok, r0, n, out),
                3 => q8_group::<3>(k, m, xq, p, tok, r0, n, out),
                2 => q8_group::<2>(k, m, xq, p, tok, r0, n, out),
                _ => q8_group::<1>(k, m, xq, p, tok, r0, n, out),
            }
        }
        tok += tn;
    }
}

/// Panel `p` against activation rows `tok..tok+T`, on path `k`, into output rows `r0..r0+n`.
///
/// # Safety
/// As [`q8_panel_into`].
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn q8_group<const T: usize>(
    k: Kernels,
    m: &Q8Matrix,
    xq: &QuantizedRows,
    p: usize,
    tok: usize,
    r0: usize,
    n: usize,
    out: &SharedMut<f32>,
) {
    let (w, a) = (m.panel(p), std::array::from_fn(|i| xq.q8_act(tok + i)));
    let y: [[f32; PANEL]; T] = match k.path() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels` is only made for supported paths.
        KernelPath::Avx512Vnni => unsafe { q8_gemm::panel_vnni512(w, a) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        KernelPath::AvxVnni => unsafe { q8_gemm::panel_avxvnni(w, a) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; AVX-512 implies AVX2.
        KernelPath::Avx2 | KernelPath::Avx512 => unsafe { q8_gemm::panel_avx2(w, a) },
        _ => q8_gemm::panel_scalar(w, a),
    };
    for (i, y) in y.iter().enumerate() {
        // SAFETY: forwarded from the caller.
        let o = unsafe { out.slice((tok + i) * m.rows + r0, n) };
        o.copy_from_slice(&y[..n]);
    }
}

/// Weight rows and activation rows per Q4 tile-kernel call.
const TILE_ROWS: usize = 4;
const TILE_TOKENS: usize = 4;

/// A block-quantized matrix with an `R × T` tile kernel.
#[cfg(target_arch = "x86_64")]
trait Tiled {
    /// Output width (the matrix's rows).
    fn rows(&self) -> usize;

    /// Rows `r..r+R` against activation rows `tok..tok+T` on path `k`: `y[row][token]`.
    ///
    /// # Safety
    /// `k` must not be the scalar path (the tiles need AVX2 at least).
    unsafe fn tile<const R: usize, const T: usize>(
        &self,
        k: Kernels,
        xq: &QuantizedRows,
        r: usize,
        tok: usize,
    ) -> [[f32; T]; R];
}

#[cfg(target_arch = "x86_64")]
impl Tiled for Q4Matrix {
    fn rows(&self) -> usize {
        self.rows
    }

    #[inline]
    unsafe fn tile<const R: usize, const T: usize>(
        &self,
        k: Kernels,
        xq: &QuantizedRows,
        r: usize,
        tok: usize,
    ) -> [[f32; T]; R] {
        let w: [_; R] = std::array::from_fn(|j| self.row(r + j));
        let a: [_; T] = std::array::from_fn(|i| xq.row_with_sums(tok + i));
        match k.path() {
            // SAFETY: `Kernels` is only made for supported paths.
            KernelPath::Avx512Vnni => unsafe { q4::tile_vnni512(w, a) },
            // SAFETY: as above; every non-scalar path has AVX2.
            _ => unsafe { q4::tile_avx2(w, a) },
        }
    }
}

/// One `R × T` tile of `m`, written into the `t × rows` output.
///
/// # Safety
/// `k` must not be the scalar path, and no other thread may touch these outputs.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn tile_into<M: Tiled, const R: usize, const T: usize>(
    k: Kernels,
    m: &M,
    xq: &QuantizedRows,
    r: usize,
    tok: usize,
    out: &SharedMut<f32>,
) {
    // SAFETY: forwarded from the caller.
    let y = unsafe { m.tile::<R, T>(k, xq, r, tok) };
    for i in 0..T {
        // SAFETY: forwarded from the caller.
        let o = unsafe { out.slice((tok + i) * m.rows() + r, R) };
        o.iter_mut().zip(&y).for_each(|(o, y)| *o = y[i]);
    }
}

/// Rows `r0..r0+n` of `m` against all `t` activation rows of `xq`, written into `out`
/// (`t × rows`), tile by tile.
///
/// # Safety
/// `k` must not be the scalar path, and no other thread may touch rows `r0..r0+n` of `out`.
#[cfg(target_arch = "x86_64")]
unsafe fn chunk_tiles<M: Tiled>(
    k: Kernels,
    m: &M,
    xq: &QuantizedRows,
    r0: usize,
    n: usize,
    t: usize,
    out: &SharedMut<f32>,
) {
    // AVX2 has 16 vector registers: a 4 × 2 tile's accumulators and operands fit, 4 × 4 spill.
    let tokens = if k.path() == KernelPath::Avx512Vnni {
        TILE_TOKENS
    } else {
        2
    };
    let mut tok = 0;
    while tok < t {
        let tn = tokens.min(t - tok);
        let mut r = r0;
        while r < r0 + n {
            let rn = if r0 + n - r >= TILE_ROWS { TILE_ROWS } else { 1 };
            // SAFETY: forwarded from the caller.
            unsafe {
                match (rn, tn) {
                    (TILE_ROWS, TILE_TOKENS) => tile_into::<_, TILE_ROWS, TILE_TOKENS>(k, m, xq, r, tok, out),
                    (TILE_ROWS, 3) => tile_into::<_, TILE_ROWS, 3>(k, m, xq, r, tok, out),
                    (TILE_ROWS, 2) => tile_into::<_, TILE_ROWS, 2>(k, m, xq, r, tok, out),
                    (TILE_ROWS, _) => tile_into::<_, TILE_ROWS, 1>(k, m, xq, r, tok, out),
                    (_, TILE_TOKENS) => tile_into::<_, 1, TILE_TOKENS>(k, m, xq, r, tok, out),
                    (_, 3) => tile_into::<_, 1, 3>(k, m, xq, r, tok, out),
                    (_, 2) => tile_into::<_, 1, 2>(k, m, xq, r, tok, out),
                    _ => tile_into::<_, 1, 1>(k, m, xq, r, tok, out),
                }
            }
            r += rn;
        }
        tok += tn;
    }
}

/// The reference product for any format: Q8_0 weights are dequantized row by row and multiplied
/// in f32 (a test oracle, slow).
pub fn matmul_reference(x: &[f32], w: MatRef<'_>, bias: Option<&[f32]>, out: &mut [f32]) {
    match w {
        MatRef::F32 { data, cols } => reference::matmul_t(x, data, bias, cols, out),
        MatRef::Q8_0(m) => {
            let mut deq = vec![0f32; m.rows * m.cols];
            for (r, row) in deq.chunks_exact_mut(m.cols).enumerate() {
                m.dequantize_row(r, row);
            }
            reference::matmul_t(x, &deq, bias, m.cols, out);
        }
        MatRef::Q4(m) => {
            let mut deq = vec![0f32; m.rows * m.cols];
            for (r, row) in deq.chunks_exact_mut(m.cols).enumerate() {
                m.dequantize_row(r, row);
            }
            reference::matmul_t(x, &deq, bias, m.cols, out);
        }
        MatRef::Half(m) => {
            let mut wide = vec![0f32; m.rows * m.cols];
            for (r, row) in wide.chunks_exact_mut(m.cols).enumerate() {
                m.widen_row(r, row);
            }
            reference::matmul_t(x, &wide, bias, m.cols, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::dispatch::KernelPath;
    use crate::kernels::cpu::f32::tests::noise;
    use crate::kernels::cpu::paths_run::PathsRun;

    #[test]
    fn f32_matmul_is_bit_identical_to_the_reference_for_any_threads_and_path() {
        let mut paths = PathsRun::new(
            "kernels::cpu::matmul::tests::f32_matmul_is_bit_identical_to_the_reference_for_any_threads_and_path",
        );
        let (rows, cols, t) = (100, 96, 3);
        let w = Matrix::from_f32(noise(rows * cols, 1, 1.0), cols, WeightFormat::F32);
        let x = noise(t * cols, 2, 2.0);
        let bias = noise(rows, 3, 0.5);
        let mut want = vec![0f32; t * rows];
        reference::matmul_t(&x, w.as_f32().unwrap(), Some(&bias), cols, &mut want);
        let mut xq = QuantizedRows::default();
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for k in Kernels::all_supported() {
                paths.record(k.path());
                let mut got = vec![0f32; t * rows];
                matmul(k, &pool, &x, w.view(), Some(&bias), &mut got, &mut xq);
                assert_eq!(got, want, "{} threads, {}", threads, k.path());
            }
        }
        paths.check(&KernelPath::ALL);
    }

    #[test]
    fn q8_matmul_is_thread_independent_and_close_to_fp32() {
        let mut paths = PathsRun::new("kernels::cpu::matmul::tests::q8_matmul_is_thread_independent_and_close_to_fp32");
        let (rows, cols, t) = (70, 576, 2);
        let wf = noise(rows * cols, 4, 0.1);
        let w = Matrix::from_f32(wf.clone(), cols, WeightFormat::Q8_0);
        assert!(matches!(w, Matrix::Q8_0(_)));
        let x = noise(t * cols, 5, 1.0);
        let mut fp32 = vec![0f32; t * rows];
        reference::matmul_t(&x, &wf, None, cols, &mut fp32);
        let mut deq = vec![0f32; t * rows];
        matmul_reference(&x, w.view(), None, &mut deq);
        let mut xq = QuantizedRows::default();
        let scalar = Kernels::with_path(super::super::dispatch::KernelPath::Scalar).unwrap();
        let mut base = vec![0f32; t * rows];
        matmul(scalar, &ThreadPool::new(1), &x, w.view(), None, &mut base, &mut xq);
        // Scale of the outputs: Σ|x·w| over a row.
        let mag: f32 = x[..cols].iter().zip(&wf[..cols]).map(|(a, b)| (a * b).abs()).sum();
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for k in Kernels::all_supported() {
                paths.record(k.path());
                let mut got = vec![0f32; t * rows];
                matmul(k, &pool, &x, w.view(), None, &mut got, &mut xq);
                if k == scalar {
                    assert_eq!(got, base, "{threads} threads");
                }
                for ((g, d), f) in got.iter().zip(&deq).zip(&fp32) {
                    // vs dequantized weights: only activation rounding (≤ half a step of 1/127
                    // of each block's max) remains, well under 1% of the magnitude.
                    assert!((g - d).abs() < 0.01 * mag, "{}: {g} vs deq {d}", k.path());
                    // vs fp32: weight and activation rounding, ≤ 2% of the magnitude.
                    assert!((g - f).abs() < 0.02 * mag, "{}: {g} vs fp32 {f}", k.path());
                }
            }
        }
        // Fused products equal separate ones.
        let w2 = Matrix::from_f32(noise(40 * cols, 6, 0.1), cols, WeightFormat::Q8_0);
        let pool = ThreadPool::new(2);
        for k in Kernels::all_supported() {
            paths.record(k.path());
            let (mut a, mut b) = (vec![0f32; t * rows], vec![0f32; t * 40]);
            matmul_many(
                k,
                &pool,
                &x,
                [(w.view(), None, &mut a), (w2.view(), None, &mut b)],
                &mut xq,
            );
            let (mut a1, mut b1) = (vec![0f32; t * rows], vec![0f32; t * 40]);
            matmul(k, &pool, &x, w.view(), None, &mut a1, &mut xq);
            matmul(k, &pool, &x, w2.view(), None, &mut b1, &mut xq);
            assert_eq!((a, b), (a1, b1), "{}", k.path());
        }
        // Identical across thread counts on every path.
        for k in Kernels::all_supported() {
            paths.record(k.path());
            let mut one = vec![0f32; t * rows];
            matmul(k, &ThreadPool::new(1), &x, w.view(), None, &mut one, &mut xq);
            let mut three = vec![0f32; t * rows];
            matmul(k, &ThreadPool::new(3), &x, w.view(), None, &mut three, &mut xq);
            assert_eq!(one, three, "{}", k.path());
        }
        paths.check(&KernelPath::ALL);
    }

    #[test]
    fn q4_matmul_equals_the_dequantized_product_on_every_path_and_thread_count() {
        let mut paths = PathsRun::new(
            "kernels::cpu::matmul::tests::q4_matmul_equals_the_dequantized_product_on_every_path_and_thread_count",
        );
        let (rows, cols, t) = (37, 576, 5);
        let x = noise(t * cols, 8, 1.0);
        let mut xq = QuantizedRows::default();
        xq.quantize(&x, cols);
        // The activations as the kernels see them: any difference left is f32 summation order.
        let xr: Vec<f32> = (0..t * cols)
            .map(|j| xq.quants[j] as f32 * xq.scales[j / baton_shared::dtype::QK])
            .collect();
        for format in [WeightFormat::Q4_0, WeightFormat::Q4_1] {
            let w = Matrix::from_f32(noise(rows * cols, 9, 0.1), cols, format);
            assert!(matches!(w, Matrix::Q4(_)), "{format}");
            let bias = noise(rows, 10, 0.5);
            let mut want = vec![0f32; t * rows];
            matmul_reference(&xr, w.view(), Some(&bias), &mut want);
            let mut first: Option<Vec<f32>> = None;
            for k in Kernels::all_supported() {
                paths.record(k.path());
                for threads in [1, 3] {
                    let mut got = vec![0f32; t * rows];
                    matmul(
                        k,
                        &ThreadPool::new(threads),
                        &x,
                        w.view(),
                        Some(&bias),
                        &mut got,
                        &mut xq,
                    );
                    for (g, e) in got.iter().zip(&want) {
                        assert!(
                            (g - e).abs() < 1e-4 * (1.0 + e.abs()),
                            "{format} {}: {g} vs {e}",
                            k.path()
                        );
                    }
                    // Thread count never changes a result on a given path.
                    match &first {
                        Some(f) if threads > 1 => assert_eq!(&got, f, "{format} {}", k.path()),
                        _ => first = Some(got),
                    }
                }
            }
        }
        paths.check(&KernelPath::ALL);
    }

    #[test]
    fn half_matmul_equals_the_reference_on_the_widened_weights_bit_for_bit() {
        let mut paths = PathsRun::new(
            "kernels::cpu::matmul::tests::half_matmul_equals_the_reference_on_the_widened_weights_bit_for_bit",
        );
        let (rows, cols, t) = (21, 96, 3);
        let x = noise(t * cols, 11, 1.0);
        let mut xq = QuantizedRows::default();
        for format in [WeightFormat::Bf16, WeightFormat::F16] {
            let w = Matrix::from_f32(noise(rows * cols, 12, 0.5), cols, format);
            assert!(matches!(w, Matrix::Half(_)), "{format}");
            assert_eq!(w.bytes(), 2 * rows * cols);
            let mut want = vec![0f32; t * rows];
            matmul_reference(&x, w.view(), None, &mut want);
            for k in Kernels::all_supported() {
                paths.record(k.path());
                for threads in [1, 3] {
                    let mut got = vec![0f32; t * rows];
                    matmul(k, &ThreadPool::new(threads), &x, w.view(), None, &mut got, &mut xq);
                    assert_eq!(got, want, "{format} {} {threads} threads", k.path());
                }
            }
        }
        // Past f16's range the matrix stays f32 rather than turning into infinities.
        let big = Matrix::from_f32(vec![1e5; 32], 32, WeightFormat::F16);
        assert!(matches!(big, Matrix::F32 { .. }));
        paths.check(&KernelPath::ALL);
    }
}
