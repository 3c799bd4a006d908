//! Q8_0 weights and 8-bit-quantized activations.
//!
//! Weights are ggml Q8_0 blocks (32 values, one scale) repacked into *panels* of
//! [`PANEL`] = 16 rows for the kernels in [`super::q8_gemm`]: within a panel and a block, four
//! consecutive quants of each of the 16 rows sit side by side, so one 64-byte load holds four
//! columns of sixteen rows and one `vpdpbusd` against four broadcast activation bytes advances
//! sixteen row sums at once (lane = output row). A row-at-a-time layout instead needs a
//! horizontal reduction and a scale multiply per row and block, which made the old kernels
//! spend more instructions on bookkeeping than on products.
//!
//! Quants are stored biased, `w + 128` as an unsigned byte, because `vpdpbusd` multiplies
//! unsigned by signed bytes and only its signed operand can be a broadcast from memory: the
//! activations stay signed, and the extra `128·Σa` of each block is cancelled by starting the
//! block's sum at `-128·Σa` ([`QuantizedRows::bias`], computed once per activation block).
//! Block scales are f32 (no f16 conversion in the inner loop), panel-ordered beside the quants.
//!
//! Activations are quantized per 32-block to i8 with an f32 scale; a block's dot product is an
//! exact i32, and blocks are accumulated in f32 in block order.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use baton_shared::dtype::QK;

use super::aligned::AlignedI8;
use super::dispatch::KernelPath;
use crate::threads::{SharedMut, ThreadPool};

/// Output rows per panel: the sixteen i32 lanes of a 512-bit vector.
pub const PANEL: usize = 16;
/// Quant bytes of one block of one panel.
pub const PANEL_BLOCK: usize = PANEL * QK;

/// Errors building a Q8_0 matrix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Q8Error {
    #[error("Q8_0 needs a row length that is a multiple of {QK}, got {0}")]
    RowLength(usize),
    #[error("Q8_0 data of {got} bytes, expected {want} for {rows}x{cols}")]
    Bytes {
        got: usize,
        want: usize,
        rows: usize,
        cols: usize,
    },
}

/// A row-major `[rows × cols]` Q8_0 matrix, repacked into panels (see the module docs). Rows
/// past `rows` in the last panel are zero weights with zero scales.
#[derive(Debug, Clone, PartialEq)]
pub struct Q8Matrix {
    pub rows: usize,
    pub cols: usize,
    /// Biased quants (`w + 128`, as the bits of an i8), panel by panel, block by block, then
    /// four-column group, row within the panel, column within the group. Starts on a cache
    /// line, so every 64-byte group does.
    quants: AlignedI8,
    /// Block scales, panel by panel, block by block, row within the panel.
    scales: Vec<f32>,
}

/// One panel's operands: `blocks × PANEL_BLOCK` biased quants and `blocks × PANEL` scales.
#[derive(Debug, Clone, Copy)]
pub struct Panel<'a> {
    pub quants: &'a [u8],
    pub scales: &'a [f32],
}

impl Q8Matrix {
    /// Repack ggml Q8_0 bytes (per block: f16 scale, 32 i8). A quant of -128 (ggml never writes
    /// one) is clamped to -127 so that every weight's negation fits a byte (the AVX2 kernel
    /// relies on it).
    pub fn from_ggml(bytes: &[u8], rows: usize, cols: usize) -> Result<Self, Q8Error> {
        let nb = ggml_blocks_per_row(bytes.len(), rows, cols)?;
        let panels = rows.div_ceil(PANEL);
        // 0x80 is a biased zero: padding rows hold zero weights.
        let mut quants = AlignedI8::zeros(panels * nb * PANEL_BLOCK);
        quants.fill(i8::MIN);
        let mut scales = vec![0f32; panels * nb * PANEL];
        for (i, block) in bytes.chunks_exact(2 + QK).enumerate() {
            let (r, b) = (i / nb, i % nb);
            scales[scale_index(nb, r, b)] = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
            for (j, &v) in block[2..].iter().enumerate() {
                quants[quant_index(nb, r, b * QK + j)] = flip_bias((v as i8).max(-127));
            }
        }
        Ok(Self {
            rows,
            cols,
            quants,
            scales,
        })
    }

    /// Quantize a row-major f32 matrix the way ggml does (f16 block scales).
    pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<Self, Q8Error> {
        if !cols.is_multiple_of(QK) {
            return Err(Q8Error::RowLength(cols));
        }
        assert_eq!(w.len(), rows * cols, "Q8Matrix::quantize: shape mismatch");
        Self::from_ggml(&baton_shared::dtype::quantize_q8_0(w), rows, cols)
    }

    /// Bytes held (quants and scales, padding rows included).
    pub fn bytes(&self) -> usize {
        self.quants.len() + 4 * self.scales.len()
    }

    /// Panels: `rows / 16`, rounded up.
    pub fn panels(&self) -> usize {
        self.rows.div_ceil(PANEL)
    }

    /// Panel `p`'s quants and scales.
    #[inline]
    pub fn panel(&self, p: usize) -> Panel<'_> {
        let nb = self.cols / QK;
        let q = &self.quants[p * nb * PANEL_BLOCK..(p + 1) * nb * PANEL_BLOCK];
        Panel {
            // SAFETY: i8 and u8 have the same size and alignment; every bit pattern is valid.
            quants: unsafe { std::slice::from_raw_parts(q.as_ptr().cast::<u8>(), q.len()) },
            scales: &self.scales[p * nb * PANEL..(p + 1) * nb * PANEL],
        }
    }

    /// The quant of row `r`, column `c` (-127..=127).
    pub fn quant(&self, r: usize, c: usize) -> i8 {
        flip_bias(self.quants[quant_index(self.cols / QK, r, c)])
    }

    /// The scale of row `r`'s block `b`.
    pub fn scale(&self, r: usize, b: usize) -> f32 {
        self.scales[scale_index(self.cols / QK, r, b)]
    }

    /// Row `r` as f32 (quant × scale) into `out` (`cols` long).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols, "dequantize_row: output length");
        for (c, o) in out.iter_mut().enumerate() {
            *o = self.quant(r, c) as f32 * self.scale(r, c / QK);
        }
    }
}

/// Blocks per row of a `rows × cols` Q8_0 matrix stored as `len` bytes of ggml blocks (an f16
/// scale and 32 quants each), or why those bytes are not one.
pub fn ggml_blocks_per_row(len: usize, rows: usize, cols: usize) -> Result<usize, Q8Error> {
    if !cols.is_multiple_of(QK) {
        return Err(Q8Error::RowLength(cols));
    }
    let want = rows * (cols / QK) * (2 + QK);
    if len != want {
        return Err(Q8Error::Bytes {
            got: len,
            want,
            rows,
            cols,
        });
    }
    Ok(cols / QK)
}

/// Where row `r`, column `c` lives in the panel-ordered quants of a matrix with `nb` blocks per
/// row.
#[inline]
fn quant_index(nb: usize, r: usize, c: usize) -> usize {
    let (p, i) = (r / PANEL, r % PANEL);
    let (b, j) = (c / QK, c % QK);
    (p * nb + b) * PANEL_BLOCK + (j / 4) * (4 * PANEL) + i * 4 + j % 4
}

/// Where row `r`'s block `b` scale lives.
#[inline]
fn scale_index(nb: usize, r: usize, b: usize) -> usize {
    ((r / PANEL) * nb + b) * PANEL + r % PANEL
}

/// `w + 128` as an unsigned byte, kept in an i8's bits, and back: flipping the top bit is its
/// own inverse.
#[inline]
fn flip_bias(w: i8) -> i8 {
    (w as u8 ^ 0x80) as i8
}

/// Activations quantized per 32-block; buffers grow to the largest batch and are reused.
#[derive(Debug, Default, Clone)]
pub struct QuantizedRows {
    pub quants: AlignedI8,
    pub scales: Vec<f32>,
    /// Per block, `scale · Σ quants`: the term Q4 weights' block offsets multiply.
    pub sums: Vec<f32>,
    /// Per block, `-128 · Σ quants`: cancels the `+128` of biased Q8_0 weights (module docs).
    pub bias: Vec<i32>,
    pub cols: usize,
}

/// One quantized activation row as the Q8_0 panel kernels read it.
#[derive(Debug, Clone, Copy)]
pub struct Q8Act<'a> {
    pub quants: &'a [i8],
    pub scales: &'a [f32],
    pub bias: &'a [i32],
}

/// Rows per pool task in [`QuantizedRows::quantize_on`].
const QUANT_ROWS: usize = 8;

/// Output slices of one quantization: quants, scales, Q4 sums, Q8 biases.
struct QuantOut<'a> {
    q: &'a mut [i8],
    d: &'a mut [f32],
    sums: &'a mut [f32],
    bias: &'a mut [i32],
}

impl QuantizedRows {
    /// Size the buffers for `x` (`cols`-wide rows, cols a multiple of 32).
    fn prepare(&mut self, x: &[f32], cols: usize) {
        assert!(cols.is_multiple_of(QK) && x.len().is_multiple_of(cols.max(1)));
        if self.quants.len() < x.len() {
            self.quants.resize(x.len());
            self.scales.resize(x.len() / QK, 0.0);
            self.sums.resize(x.len() / QK, 0.0);
            self.bias.resize(x.len() / QK, 0);
        }
        self.cols = cols;
    }

    /// Quantize every `cols`-wide row of `x` (cols a multiple of 32).
    pub fn quantize(&mut self, x: &[f32], cols: usize) {
        self.prepare(x, cols);
        let nb = x.len() / QK;
        quantize_any(
            x,
            QuantOut {
                q: &mut self.quants[..x.len()],
                d: &mut self.scales[..nb],
                sums: &mut self.sums[..nb],
                bias: &mut self.bias[..nb],
            },
        );
    }

    /// [`quantize`](Self::quantize) with the rows spread over `pool`: every block is quantized
    /// on its own, so the result is the same. A prefill quantizes thousands of rows per
    /// product; on the caller alone the other threads would wait.
    pub fn quantize_on(&mut self, pool: &ThreadPool, x: &[f32], cols: usize) {
        let rows = x.len() / cols.max(1);
        if pool.threads() == 1 || rows < 2 * QUANT_ROWS {
            return self.quantize(x, cols);
        }
        self.prepare(x, cols);
        let nb = x.len() / QK;
        let q = SharedMut::new(&mut self.quants[..x.len()]);
        let d = SharedMut::new(&mut self.scales[..nb]);
        let s = SharedMut::new(&mut self.sums[..nb]);
        let c = SharedMut::new(&mut self.bias[..nb]);
        pool.run(rows.div_ceil(QUANT_ROWS), &|task| {
            let r0 = task * QUANT_ROWS;
            let n = QUANT_ROWS.min(rows - r0);
            let (v0, v) = (r0 * cols, n * cols);
            let (b0, b) = (v0 / QK, v / QK);
            // SAFETY: tasks cover disjoint row ranges.
            let out = unsafe {
                QuantOut {
                    q: q.slice(v0, v),
                    d: d.slice(b0, b),
                    sums: s.slice(b0, b),
                    bias: c.slice(b0, b),
                }
            };
            quantize_any(&x[v0..v0 + v], out);
        });
    }

    /// Row `i`'s quants and scales.
    #[inline]
    pub fn row(&self, i: usize) -> (&[i8], &[f32]) {
        let nb = self.cols / QK;
        (
            &self.quants[i * self.cols..(i + 1) * self.cols],
            &self.scales[i * nb..(i + 1) * nb],
        )
    }

    /// Row `i` for the Q8_0 panel kernels.
    #[inline]
    pub fn q8_act(&self, i: usize) -> Q8Act<'_> {
        let (quants, scales) = self.row(i);
        let nb = self.cols / QK;
        Q8Act {
            quants,
            scales,
            bias: &self.bias[i * nb..(i + 1) * nb],
        }
    }
}

/// [`quantize_blocks`] on the fastest code this CPU runs (identical results).
fn quantize_any(x: &[f32], out: QuantOut<'_>) {
    #[cfg(target_arch = "x86_64")]
    {
        if KernelPath::Avx512.is_supported() {
            // SAFETY: checked just above.
            return unsafe { quantize_blocks_avx512(x, out) };
        }
        if KernelPath::Avx2.is_supported() {
            // SAFETY: checked just above.
            return unsafe { quantize_blocks_avx2(x, out) };
        }
    }
    quantize_blocks(x, out);
}

/// [`quantize_block`] over consecutive blocks: the scalar reference twin.
#[inline(always)]
fn quantize_blocks(x: &[f32], out: QuantOut<'_>) {
    let blocks = x.chunks_exact(QK).zip(out.q.chunks_exact_mut(QK));
    for (((xb, qb), d), (s, c)) in blocks.zip(out.d).zip(out.sums.iter_mut().zip(out.bias)) {
        *d = quantize_block(xb, qb);
        let total = qb.iter().map(|&v| v as i32).sum::<i32>();
        *s = *d * total as f32;
        *c = -128 * total;
    }
}

/// [`quantize_blocks`] compiled for AVX2 (LLVM vectorizes the rounding and clamping).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_blocks_avx2(x: &[f32], out: QuantOut<'_>) {
    quantize_blocks(x, out);
}

/// [`quantize_blocks`] in AVX-512 by hand: a block is two vectors, so the maximum, rounding,
/// narrowing and sum each take a few instructions instead of LLVM's per-value shuffles (the
/// compiled loop was 9% of a 16-stream decode profile). Same operations per value, so the same
/// bits for every finite input.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn quantize_blocks_avx512(x: &[f32], out: QuantOut<'_>) {
    let nb = x.len() / QK;
    assert!(out.q.len() >= nb * QK && out.d.len() >= nb && out.sums.len() >= nb && out.bias.len() >= nb);
    let half = _mm512_set1_ps(0.5);
    let one = _mm512_set1_ps(1.0);
    let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    for b in 0..nb {
        // SAFETY: block b is inside `x` and every output (checked above).
        unsafe {
            let v = [0, 16].map(|o| _mm512_loadu_ps(x.as_ptr().add(b * QK + o)));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            let d = amax / 127.0;
            let id = _mm512_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
            let q = v.map(|v| {
                let y = _mm512_mul_ps(v, id);
                // round_half_away: truncate, then step away from zero when the cut was ≥ 0.5.
                let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                let away = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_abs_ps(_mm512_sub_ps(y, t)), half);
                let step = _mm512_or_ps(_mm512_and_ps(y, _mm512_set1_ps(-0.0)), one);
                let r = _mm512_mask_add_ps(t, away, t, step);
                _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi))
            });
            let dst = out.q.as_mut_ptr().add(b * QK);
            _mm_storeu_si128(dst.cast(), _mm512_cvtepi32_epi8(q[0]));
            _mm_storeu_si128(dst.add(16).cast(), _mm512_cvtepi32_epi8(q[1]));
            let total = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
            *out.d.get_unchecked_mut(b) = d;
            *out.sums.get_unchecked_mut(b) = d * total as f32;
            *out.bias.get_unchecked_mut(b) = -128 * total;
        }
    }
}

/// Quantize one block to i8 with scale max|x|/127 (round to nearest); returns the scale.
#[inline]
pub fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, &v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (o, &v) in q.iter_mut().zip(x) {
        *o = round_half_away(v * id).clamp(-127.0, 127.0) as i8;
    }
    d
}

/// `x.round()` (halves away from zero, as ggml's `roundf`) from operations that vectorize on
/// every x86 path: LLVM lowers `f32::round` to a libm call per value below AVX-512. Exact:
/// `x - trunc(x)` is exact for every f32, and is ±0.5 or more exactly when rounding goes away
/// from zero.
#[inline(always)]
pub fn round_half_away(x: f32) -> f32 {
    let t = x.trunc();
    if (x - t).abs() >= 0.5 { t + 1f32.copysign(x) } else { t }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::dispatch::KernelPath;
    use crate::kernels::cpu::paths_run::PathsRun;

    fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        crate::kernels::cpu::f32::tests::noise(n, seed, scale)
    }

    #[test]
    fn round_half_away_is_f32_round() {
        let mut cases = vec![
            0.0f32,
            -0.0,
            0.5,
            -0.5,
            1.5,
            -2.5,
            0.49999997,
            -0.49999997,
            126.5,
            -127.5,
            8388607.5,
        ];
        cases.extend([
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        cases.extend((0..100_000).map(|i| (i as f32 - 50_000.0) * 0.0031));
        for x in cases {
            assert_eq!(round_half_away(x).to_bits(), x.round().to_bits(), "{x}");
        }
        assert!(round_half_away(f32::NAN).is_nan());
    }

    /// Quants, scales, sums and biases of `x` from one of the `quantize_blocks` variants.
    type Quantized = (Vec<i8>, Vec<f32>, Vec<f32>, Vec<i32>);

    fn quantized_by(x: &[f32], f: impl Fn(&[f32], QuantOut<'_>)) -> Quantized {
        let nb = x.len() / QK;
        let (mut q, mut d, mut s, mut c) = (vec![0i8; x.len()], vec![0f32; nb], vec![0f32; nb], vec![0i32; nb]);
        f(
            x,
            QuantOut {
                q: &mut q,
                d: &mut d,
                sums: &mut s,
                bias: &mut c,
            },
        );
        (q, d, s, c)
    }

    #[test]
    fn vector_quantization_equals_the_scalar_blocks() {
        let mut x = noise(4 * 96, 11, 3.0);
        // Ties: ±k.5 steps round away from zero, as ggml's roundf does.
        x[..QK]
            .iter_mut()
            .enumerate()
            .for_each(|(j, v)| *v = (j as f32 - 15.5) * 2.0);
        x[0] = 127.0 * 2.0;
        // An all-zero block (scale 0), a block of one huge value and a block of tiny ones.
        x[QK..2 * QK].fill(0.0);
        x[2 * QK + 5] = -3e38;
        x[3 * QK..4 * QK].iter_mut().for_each(|v| *v *= 1e-30);
        let want = quantized_by(&x, quantize_blocks);
        let (q, d, s, c) = &want;
        let mut paths = PathsRun::new("kernels::cpu::q8::tests::vector_quantization_equals_the_scalar_blocks");
        paths.record(KernelPath::Scalar);
        #[cfg(target_arch = "x86_64")]
        {
            if KernelPath::Avx2.is_supported() {
                paths.record(KernelPath::Avx2);
                // SAFETY: checked just above.
                assert_eq!(
                    quantized_by(&x, |x, o| unsafe { quantize_blocks_avx2(x, o) }),
                    want,
                    "avx2"
                );
            }
            if KernelPath::Avx512.is_supported() {
                paths.record(KernelPath::Avx512);
                // SAFETY: checked just above.
                assert_eq!(
                    quantized_by(&x, |x, o| unsafe { quantize_blocks_avx512(x, o) }),
                    want,
                    "avx512"
                );
            }
        }
        let mut xq = QuantizedRows::default();
        xq.quantize(&x, 96);
        assert_eq!(&xq.quants[..], &q[..]);
        assert_eq!((&xq.scales, &xq.sums, &xq.bias), (d, s, c));
        let block0: i32 = q[..QK].iter().map(|&v| v as i32).sum();
        assert_eq!((s[0], c[0]), (d[0] * block0 as f32, -128 * block0));
        // Scale 2: x[15] = -1 is -0.5 steps → -1, x[31] = 31 is 15.5 steps → 16.
        assert_eq!((q[15], q[31]), (-1, 16));
        assert_eq!((d[1], c[1]), (0.0, 0));
        assert_eq!(q[2 * QK + 5], -127);
        paths.check(&[KernelPath::Scalar, KernelPath::Avx2, KernelPath::Avx512]);
    }

    #[test]
    fn quantizing_on_a_pool_equals_quantizing_on_the_caller() {
        let x = noise(37 * 96, 12, 2.0);
        let (mut one, mut many) = (QuantizedRows::default(), QuantizedRows::default());
        one.quantize(&x, 96);
        many.quantize_on(&ThreadPool::new(3), &x, 96);
        assert_eq!(
            (&one.quants[..], &one.scales, &one.sums, &one.bias),
            (&many.quants[..], &many.scales, &many.sums, &many.bias)
        );
    }

    #[test]
    fn activation_quantization_round_trips_within_half_a_step() {
        let x = noise(96, 5, 3.0);
        let mut xq = QuantizedRows::default();
        xq.quantize(&x, 96);
        for (i, &v) in x.iter().enumerate() {
            let d = xq.scales[i / QK];
            assert!((xq.quants[i] as f32 * d - v).abs() <= 0.5 * d + 1e-6);
        }
        xq.quantize(&[0.0; 32], 32);
        assert_eq!(xq.scales[0], 0.0);
        assert!(xq.quants[..32].iter().all(|&q| q == 0));
    }

    #[test]
    fn panels_hold_every_weight_once_and_pad_with_zero_rows() {
        // 37 rows: two full panels and a padded third; -128 from a file is clamped to -127.
        let (rows, cols) = (37, 96);
        let w = noise(rows * cols, 3, 1.0);
        let m = Q8Matrix::quantize(&w, rows, cols).unwrap();
        assert_eq!(m.panels(), 3);
        assert_eq!(m.bytes(), 3 * PANEL * cols + 4 * 3 * PANEL * (cols / QK));
        let ggml = baton_shared::dtype::quantize_q8_0(&w);
        for r in 0..rows {
            for b in 0..cols / QK {
                let block = &ggml[(r * cols / QK + b) * (2 + QK)..][..2 + QK];
                assert_eq!(m.scale(r, b), half::f16::from_le_bytes([block[0], block[1]]).to_f32());
                for j in 0..QK {
                    assert_eq!(m.quant(r, b * QK + j), block[2 + j] as i8, "row {r} col {}", b * QK + j);
                }
            }
        }
        let last = m.panel(2);
        assert_eq!(last.quants.len(), (cols / QK) * PANEL_BLOCK);
        for r in rows..3 * PANEL {
            assert_eq!(m.scale(r, 0), 0.0);
            assert!((0..cols).all(|c| m.quant(r, c) == 0));
        }
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
        bytes.extend((0..QK).map(|j| if j % 2 == 0 { 0x80u8 } else { 127 }));
        let m = Q8Matrix::from_ggml(&bytes, 1, QK).unwrap();
        assert!((0..QK).all(|c| m.quant(0, c).abs() == 127));
        let mut row = vec![0f32; QK];
        m.dequantize_row(0, &mut row);
        assert_eq!((row[0], row[1]), (-127.0, 127.0));
    }
}
