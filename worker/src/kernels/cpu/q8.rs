//! Q8_0 weights × 8-bit-quantized activations.
//!
//! Weights are kept as ggml Q8_0 blocks (32 values, one scale) but repacked into two arrays,
//! quants `[rows × cols]` i8 and scales `[rows × cols/32]` f32, so a row's quants are contiguous
//! and aligned for vector loads and the scale costs no f16 conversion in the inner loop.
//! Activations are quantized per 32-block to i8 with an f32 scale; a block's dot product is an
//! exact i32, and blocks are accumulated in f32.
//!
//! `vpdpbusd` and `vpmaddubsw` multiply unsigned by signed bytes. We feed them |a| (unsigned)
//! and w with a's sign applied (`vpsignb`), so |a|·(sign(a)·w) = a·w exactly. That needs w ≠ -128
//! (its negation overflows); ggml never produces -128 and [`Q8Matrix`] clamps it to -127.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use baton_shared::dtype::QK;

use super::aligned::AlignedI8;
use super::dispatch::{KernelPath, Kernels};
use crate::threads::{SharedMut, ThreadPool};

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

/// A row-major `[rows × cols]` Q8_0 matrix, repacked for the kernels (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Q8Matrix {
    pub rows: usize,
    pub cols: usize,
    /// `rows × cols` quants, each in -127..=127, starting on a cache line.
    pub quants: AlignedI8,
    /// `rows × cols / 32` block scales.
    pub scales: Vec<f32>,
}

impl Q8Matrix {
    /// Repack ggml Q8_0 bytes (per block: f16 scale, 32 i8).
    pub fn from_ggml(bytes: &[u8], rows: usize, cols: usize) -> Result<Self, Q8Error> {
        if !cols.is_multiple_of(QK) {
            return Err(Q8Error::RowLength(cols));
        }
        let want = rows * cols / QK * (2 + QK);
        if bytes.len() != want {
            return Err(Q8Error::Bytes {
                got: bytes.len(),
                want,
                rows,
                cols,
            });
        }
        let mut quants = AlignedI8::zeros(rows * cols);
        let mut scales = Vec::with_capacity(rows * cols / QK);
        for (b, q) in bytes.chunks_exact(2 + QK).zip(quants.chunks_exact_mut(QK)) {
            scales.push(half::f16::from_le_bytes([b[0], b[1]]).to_f32());
            q.iter_mut().zip(&b[2..]).for_each(|(q, &v)| *q = (v as i8).max(-127));
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

    /// Bytes held (quants and scales).
    pub fn bytes(&self) -> usize {
        self.quants.len() + 4 * self.scales.len()
    }

    /// Row `r`'s quants and scales.
    #[inline]
    pub fn row(&self, r: usize) -> (&[i8], &[f32]) {
        let nb = self.cols / QK;
        (
            &self.quants[r * self.cols..(r + 1) * self.cols],
            &self.scales[r * nb..(r + 1) * nb],
        )
    }
}

/// Activations quantized per 32-block; buffers grow to the largest batch and are reused.
#[derive(Debug, Default, Clone)]
pub struct QuantizedRows {
    pub quants: AlignedI8,
    pub scales: Vec<f32>,
    /// Per block, `scale · Σ quants`: the term Q4 weights' block offsets multiply.
    pub sums: Vec<f32>,
    pub cols: usize,
}

/// Rows per pool task in [`QuantizedRows::quantize_on`].
const QUANT_ROWS: usize = 8;

impl QuantizedRows {
    /// Size the buffers for `x` (`cols`-wide rows, cols a multiple of 32).
    fn prepare(&mut self, x: &[f32], cols: usize) {
        assert!(cols.is_multiple_of(QK) && x.len().is_multiple_of(cols.max(1)));
        if self.quants.len() < x.len() {
            self.quants.resize(x.len());
            self.scales.resize(x.len() / QK, 0.0);
            self.sums.resize(x.len() / QK, 0.0);
        }
        self.cols = cols;
    }

    /// Quantize every `cols`-wide row of `x` (cols a multiple of 32).
    pub fn quantize(&mut self, x: &[f32], cols: usize) {
        self.prepare(x, cols);
        let nb = x.len() / QK;
        quantize_any(
            x,
            &mut self.quants[..x.len()],
            &mut self.scales[..nb],
            &mut self.sums[..nb],
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
        pool.run(rows.div_ceil(QUANT_ROWS), &|task| {
            let r0 = task * QUANT_ROWS;
            let n = QUANT_ROWS.min(rows - r0);
            let (v0, v) = (r0 * cols, n * cols);
            // SAFETY: tasks cover disjoint row ranges.
            let (qs, ds, ss) = unsafe { (q.slice(v0, v), d.slice(v0 / QK, v / QK), s.slice(v0 / QK, v / QK)) };
            quantize_any(&x[v0..v0 + v], qs, ds, ss);
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
}

/// [`quantize_blocks`] on the fastest compilation this CPU runs (identical results).
fn quantize_any(x: &[f32], q: &mut [i8], d: &mut [f32], sums: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if KernelPath::Avx2.is_supported() {
        // SAFETY: checked just above.
        return unsafe { quantize_blocks_avx2(x, q, d, sums) };
    }
    quantize_blocks(x, q, d, sums);
}

/// [`quantize_block`] over consecutive blocks.
#[inline(always)]
fn quantize_blocks(x: &[f32], q: &mut [i8], d: &mut [f32], sums: &mut [f32]) {
    for (((xb, qb), d), s) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).zip(d).zip(sums) {
        *d = quantize_block(xb, qb);
        *s = *d * qb.iter().map(|&v| v as i32).sum::<i32>() as f32;
    }
}

/// [`quantize_blocks`] compiled for AVX2: the same arithmetic in vector instructions (a prefill
/// quantizes every activation).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_blocks_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], sums: &mut [f32]) {
    quantize_blocks(x, q, d, sums);
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

/// Σ over blocks of `wd·ad·(wq·aq)`, on the given path.
#[inline]
pub fn dot(k: Kernels, wq: &[i8], wd: &[f32], aq: &[i8], ad: &[f32]) -> f32 {
    assert!(wq.len() == aq.len() && wd.len() == ad.len() && wq.len() == wd.len() * QK);
    match k.path() {
        KernelPath::Scalar => dot_scalar(wq, wd, aq, ad),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels` is only made for paths the CPU supports.
        KernelPath::Avx2 | KernelPath::Avx512 => unsafe { dot_avx2(wq, wd, aq, ad) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        KernelPath::Avx512Vnni => unsafe { dot_vnni(wq, wd, aq, ad) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => dot_scalar(wq, wd, aq, ad),
    }
}

/// Scalar reference twin: exact i32 per block, then f32.
pub fn dot_scalar(wq: &[i8], wd: &[f32], aq: &[i8], ad: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (((wb, &dw), ab), &da) in wq.chunks_exact(QK).zip(wd).zip(aq.chunks_exact(QK)).zip(ad) {
        let s: i32 = wb.iter().zip(ab).map(|(&w, &a)| w as i32 * a as i32).sum();
        acc += dw * da * s as f32;
    }
    acc
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn hsum8(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2)))
}

/// AVX2 twin: `vpmaddubsw` (pairs to i16, at most 2·127·127, no saturation) then `vpmaddwd`;
/// it is the `1 × 1` [`super::q8_gemm::tile_avx2`], so rows computed in tiles give its bits.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_avx2(wq: &[i8], wd: &[f32], aq: &[i8], ad: &[f32]) -> f32 {
    // SAFETY: same features.
    unsafe { super::q8_gemm::tile_avx2::<1, 1>([wq], [wd], [aq], [ad])[0][0] }
}

/// AVX-512 VNNI twin for one row: [`dot_vnni_rows`] with `R = 1`.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL/VNNI, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub unsafe fn dot_vnni(wq: &[i8], wd: &[f32], aq: &[i8], ad: &[f32]) -> f32 {
    // SAFETY: same features.
    unsafe { dot_vnni_rows::<1>([wq], [wd], aq, ad)[0] }
}

/// AVX-512 VNNI kernel for `R` weight rows against one activation row: one block per 256-bit
/// `vpdpbusd` (AVX-512VL), the activation's |a| computed once for all `R` rows. Each row's
/// arithmetic is the same for any `R`, so grouping rows never changes a result.
///
/// 256-bit rather than 512-bit vectors: measured in batch-1 decode on this Xeon, the 512-bit
/// variant (two blocks per instruction) was ~25% slower end to end although faster in an
/// isolated L2-resident loop, consistent with the clock penalty of 512-bit integer multiplies.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL/VNNI, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub unsafe fn dot_vnni_rows<const R: usize>(wq: [&[i8]; R], wd: [&[f32]; R], aq: &[i8], ad: &[f32]) -> [f32; R] {
    let nb = ad.len().min(aq.len() / QK);
    for r in 0..R {
        assert!(
            wq[r].len() >= nb * QK && wd[r].len() >= nb,
            "dot_vnni_rows: row too short"
        );
    }
    let zero = _mm256_setzero_si256();
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // Rows of a matrix are contiguous: prefetch the group of rows after next. Reading R rows
    // side by side defeats the hardware streamers (measured: 12 vs 20 GB/s on the 49152-row head
    // without this); a prefetch never faults, so running past the matrix is harmless.
    let ahead = wq[0].as_ptr().wrapping_add(super::PREFETCH_TILES * R * nb * QK);
    for b in 0..nb {
        super::prefetch(ahead.wrapping_add(b * R * QK), R * QK);
        // SAFETY: block b is inside every slice (checked above).
        unsafe {
            let a = _mm256_loadu_si256(aq.as_ptr().add(b * QK).cast());
            let ua = _mm256_abs_epi8(a);
            for r in 0..R {
                let w = _mm256_loadu_si256(wq[r].as_ptr().add(b * QK).cast());
                // w with a's sign: |a|·(±w) = a·w, and |a| fits the unsigned operand.
                let p = _mm256_dpbusd_epi32(zero, ua, _mm256_sign_epi8(w, a));
                let d = _mm256_set1_ps(*wd[r].get_unchecked(b) * *ad.get_unchecked(b));
                // Two accumulators per row: consecutive blocks do not wait on each other's FMA.
                acc[r][b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[r][b & 1]);
            }
        }
    }
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
    out
}

/// Four rows at once against one activation row; equal to four [`dot`] calls.
#[inline]
pub fn dot4(k: Kernels, wq: [&[i8]; 4], wd: [&[f32]; 4], aq: &[i8], ad: &[f32]) -> [f32; 4] {
    for r in 0..4 {
        assert!(wq[r].len() == aq.len() && wd[r].len() == ad.len() && aq.len() == ad.len() * QK);
    }
    match k.path() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels` is only made for paths the CPU supports.
        KernelPath::Avx512Vnni => unsafe { dot_vnni_rows::<4>(wq, wd, aq, ad) },
        _ => [0, 1, 2, 3].map(|r| dot(k, wq[r], wd[r], aq, ad)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        crate::kernels::cpu::f32::tests::noise(n, seed, scale)
    }

    /// |Σ| bound used for a relative tolerance: Σ over blocks of |wd·ad|·Σ|wq·aq|.
    fn magnitude(wq: &[i8], wd: &[f32], aq: &[i8], ad: &[f32]) -> f32 {
        let mut m = 0f32;
        for (((wb, &dw), ab), &da) in wq.chunks_exact(QK).zip(wd).zip(aq.chunks_exact(QK)).zip(ad) {
            let s: i32 = wb.iter().zip(ab).map(|(&w, &a)| (w as i32 * a as i32).abs()).sum();
            m += (dw * da).abs() * s as f32;
        }
        m
    }

    #[test]
    fn simd_paths_match_the_scalar_twin() {
        for k in Kernels::all_supported() {
            for cols in [32, 64, 96, 576, 1536] {
                for (seed, scale) in [(1u64, 1.0f32), (2, 1e3), (3, 1e-5)] {
                    let w = noise(4 * cols, seed, scale);
                    let m = Q8Matrix::quantize(&w, 4, cols).unwrap();
                    let mut x = noise(cols, seed + 7, 1.0);
                    x[0] = 0.0;
                    x[cols - 1] = -1.0; // the extreme quant -127
                    let mut xq = QuantizedRows::default();
                    xq.quantize(&x, cols);
                    let (aq, ad) = xq.row(0);
                    for r in 0..4 {
                        let (wq, wd) = m.row(r);
                        let want = dot_scalar(wq, wd, aq, ad);
                        let got = dot(k, wq, wd, aq, ad);
                        // Only the f32 accumulation order differs: a few ulps of the magnitude.
                        let tol = 1e-6 * magnitude(wq, wd, aq, ad);
                        assert!((got - want).abs() <= tol, "{} cols={cols}: {got} vs {want}", k.path());
                    }
                }
            }
            // Grouped rows give exactly the single-row results, also for an odd block count.
            for cols in [96, 576] {
                let w = noise(4 * cols, 9, 1.0);
                let m = Q8Matrix::quantize(&w, 4, cols).unwrap();
                let mut xq = QuantizedRows::default();
                xq.quantize(&noise(cols, 10, 1.0), cols);
                let (aq, ad) = xq.row(0);
                let rows = [0, 1, 2, 3].map(|r| m.row(r));
                let four = dot4(k, rows.map(|r| r.0), rows.map(|r| r.1), aq, ad);
                let one = rows.map(|(wq, wd)| dot(k, wq, wd, aq, ad));
                assert_eq!(four, one, "{} cols={cols}", k.path());
            }
            // Extreme quants: every product 127·127 in a block; -128 from a file is clamped.
            let mut bytes = Vec::new();
            for _ in 0..2 {
                bytes.extend_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
                bytes.extend((0..QK).map(|j| if j % 2 == 0 { 0x80u8 } else { 127 }));
            }
            let m = Q8Matrix::from_ggml(&bytes, 1, 2 * QK).unwrap();
            assert!(m.quants.iter().all(|&q| q.abs() == 127));
            let aq: Vec<i8> = (0..2 * QK).map(|j| if j % 3 == 0 { -127 } else { 127 }).collect();
            let ad = [1.0f32, 1.0];
            let (wq, wd) = m.row(0);
            assert_eq!(dot(k, wq, wd, &aq, &ad), dot_scalar(wq, wd, &aq, &ad), "{}", k.path());
        }
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

    #[test]
    fn vector_quantization_equals_the_scalar_blocks() {
        let mut x = noise(4 * 96, 11, 3.0);
        // Ties: ±k.5 steps round away from zero, as ggml's roundf does.
        x[..QK]
            .iter_mut()
            .enumerate()
            .for_each(|(j, v)| *v = (j as f32 - 15.5) * 2.0);
        x[0] = 127.0 * 2.0;
        let mut xq = QuantizedRows::default();
        xq.quantize(&x, 96);
        let (mut q, mut d, mut s) = (vec![0i8; x.len()], vec![0f32; x.len() / QK], vec![0f32; x.len() / QK]);
        quantize_blocks(&x, &mut q, &mut d, &mut s);
        assert_eq!(&xq.quants[..], &q[..]);
        assert_eq!((&xq.scales, &xq.sums), (&d, &s));
        let block0: i32 = q[..QK].iter().map(|&v| v as i32).sum();
        assert_eq!(s[0], d[0] * block0 as f32);
        // Scale 2: x[15] = -1 is -0.5 steps → -1, x[31] = 31 is 15.5 steps → 16.
        assert_eq!((q[15], q[31]), (-1, 16));
    }

    #[test]
    fn quantizing_on_a_pool_equals_quantizing_on_the_caller() {
        let x = noise(37 * 96, 12, 2.0);
        let (mut one, mut many) = (QuantizedRows::default(), QuantizedRows::default());
        one.quantize(&x, 96);
        many.quantize_on(&ThreadPool::new(3), &x, 96);
        assert_eq!(
            (&one.quants[..], &one.scales, &one.sums),
            (&many.quants[..], &many.scales, &many.sums)
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
}
