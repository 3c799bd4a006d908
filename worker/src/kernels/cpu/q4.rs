//! Q4_0 and Q4_1 weights × 8-bit-quantized activations.
//!
//! Both formats store 32 values per block as 4-bit codes `q` (0..=15) and decode as
//! `w = d·q + m`: Q4_1 keeps the block minimum `m`, Q4_0 is the case `m = -8·d`. So one kernel
//! serves both, and a block's product with activations `a` (scale `s`) is
//! `d·s·Σ q·a + m·(s·Σ a)`; the second term uses the activation block sums that
//! [`QuantizedRows`] keeps. `Σ q·a` is unsigned × signed bytes, exactly what `vpdpbusd` does.
//!
//! Codes keep ggml's packing (byte `j` of a block holds value `j` in its low nibble and value
//! `j + 16` in its high one), so a file's Q4 tensors load as they are. Scales and minimums are
//! widened to f32 at load: no conversion in the inner loop.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::{PREFETCH_TILES, prefetch};

use baton_shared::dtype::{DType, QK};

use super::aligned::AlignedI8;
use super::dispatch::{KernelPath, Kernels};
use super::q8::QuantizedRows;

/// Errors building a Q4 matrix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Q4Error {
    #[error("Q4 needs a row length that is a multiple of {QK}, got {0}")]
    RowLength(usize),
    #[error("{dtype} data of {got} bytes, expected {want} for {rows}x{cols}")]
    Bytes {
        dtype: DType,
        got: usize,
        want: usize,
        rows: usize,
        cols: usize,
    },
    #[error("{0} is not a 4-bit format")]
    NotQ4(DType),
}

/// A row-major `[rows × cols]` Q4_0 or Q4_1 matrix (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Q4Matrix {
    pub rows: usize,
    pub cols: usize,
    /// Which file format the codes came from (Q4_0 or Q4_1).
    pub dtype: DType,
    /// `rows × cols / 2` bytes of packed codes, starting on a cache line.
    pub codes: AlignedI8,
    /// `rows × cols / 32` block scales `d`.
    pub scales: Vec<f32>,
    /// `rows × cols / 32` block offsets `m`.
    pub mins: Vec<f32>,
}

/// Bytes before the codes in each block of `dtype` (2: Q4_0's f16 `d`; 4: Q4_1's `d` and `m`),
/// once `len` bytes are checked to be a `rows × cols` matrix of such blocks.
pub fn ggml_q4_head(dtype: DType, len: usize, rows: usize, cols: usize) -> Result<usize, Q4Error> {
    let head = match dtype {
        DType::Q4_0 => 2,
        DType::Q4_1 => 4,
        other => return Err(Q4Error::NotQ4(other)),
    };
    if !cols.is_multiple_of(QK) {
        return Err(Q4Error::RowLength(cols));
    }
    let want = dtype.n_bytes(rows * cols);
    if len != want {
        return Err(Q4Error::Bytes {
            dtype,
            got: len,
            want,
            rows,
            cols,
        });
    }
    Ok(head)
}

impl Q4Matrix {
    /// Repack ggml Q4_0 (f16 `d`, 16 code bytes) or Q4_1 (f16 `d`, f16 `m`, 16 code bytes) blocks.
    pub fn from_ggml(dtype: DType, bytes: &[u8], rows: usize, cols: usize) -> Result<Self, Q4Error> {
        let head = ggml_q4_head(dtype, bytes.len(), rows, cols)?;
        let blocks = rows * cols / QK;
        let mut codes = AlignedI8::zeros(rows * cols / 2);
        let (mut scales, mut mins) = (Vec::with_capacity(blocks), Vec::with_capacity(blocks));
        let f16 = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
        for (b, c) in bytes.chunks_exact(head + QK / 2).zip(codes.chunks_exact_mut(QK / 2)) {
            let d = f16(b, 0);
            scales.push(d);
            mins.push(if head == 4 { f16(b, 2) } else { -8.0 * d });
            c.iter_mut().zip(&b[head..]).for_each(|(c, &v)| *c = v as i8);
        }
        Ok(Self {
            rows,
            cols,
            dtype,
            codes,
            scales,
            mins,
        })
    }

    /// Quantize a row-major f32 matrix to `dtype` (Q4_0 or Q4_1) the way ggml does.
    pub fn quantize(w: &[f32], rows: usize, cols: usize, dtype: DType) -> Result<Self, Q4Error> {
        if !cols.is_multiple_of(QK) {
            return Err(Q4Error::RowLength(cols));
        }
        assert_eq!(w.len(), rows * cols, "Q4Matrix::quantize: shape mismatch");
        let bytes = match dtype {
            DType::Q4_0 => baton_shared::dtype::quantize_q4_0(w),
            DType::Q4_1 => baton_shared::dtype::quantize_q4_1(w),
            other => return Err(Q4Error::NotQ4(other)),
        };
        Self::from_ggml(dtype, &bytes, rows, cols)
    }

    /// Bytes held (codes, scales and minimums).
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * (self.scales.len() + self.mins.len())
    }

    /// Row `r`: codes, scales, minimums.
    #[inline]
    pub fn row(&self, r: usize) -> (&[i8], &[f32], &[f32]) {
        let nb = self.cols / QK;
        (
            &self.codes[r * self.cols / 2..(r + 1) * self.cols / 2],
            &self.scales[r * nb..(r + 1) * nb],
            &self.mins[r * nb..(r + 1) * nb],
        )
    }

    /// Row `r` decoded to f32 (for the reference product and tests).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (c, d, m) = self.row(r);
        for (((o, c), &d), &m) in out.chunks_exact_mut(QK).zip(c.chunks_exact(QK / 2)).zip(d).zip(m) {
            for (j, &byte) in c.iter().enumerate() {
                let byte = byte as u8;
                o[j] = (byte & 0x0f) as f32 * d + m;
                o[j + QK / 2] = (byte >> 4) as f32 * d + m;
            }
        }
    }
}

/// One row's view: codes, scales, minimums.
pub type Q4Row<'a> = (&'a [i8], &'a [f32], &'a [f32]);

/// One activation row's view: quants, scales, block sums (`s·Σa`).
pub type ActRow<'a> = (&'a [i8], &'a [f32], &'a [f32]);

/// Scalar reference: per block the exact integer `Σ q·a`, then `d·s·Σqa + m·(s·Σa)` in f32.
pub fn dot_scalar(w: Q4Row<'_>, a: ActRow<'_>) -> f32 {
    let ((codes, d, m), (aq, ad, asum)) = (w, a);
    let mut acc = 0f32;
    for (b, (c, ab)) in codes.chunks_exact(QK / 2).zip(aq.chunks_exact(QK)).enumerate() {
        let mut s = 0i32;
        for (j, &byte) in c.iter().enumerate() {
            let byte = byte as u8;
            s += (byte & 0x0f) as i32 * ab[j] as i32 + (byte >> 4) as i32 * ab[j + QK / 2] as i32;
        }
        acc += d[b] * ad[b] * s as f32 + m[b] * asum[b];
    }
    acc
}

/// One row's product on path `k`: the AVX2 kernel on AVX2 and plain AVX-512 machines (VNNI ones
/// run the tiles instead), else the scalar twin.
#[inline]
pub fn dot(k: Kernels, w: Q4Row<'_>, a: ActRow<'_>) -> f32 {
    match k.path() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels` is only made for paths the CPU supports; every path past scalar has AVX2.
        KernelPath::Avx2 | KernelPath::AvxVnni | KernelPath::Avx512 | KernelPath::Avx512Vnni => unsafe {
            dot_avx2(w, a)
        },
        _ => dot_scalar(w, a),
    }
}

/// AVX2 twin of [`dot_scalar`]: the `1 × 1` [`tile_avx2`].
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_avx2(w: Q4Row<'_>, a: ActRow<'_>) -> f32 {
    // SAFETY: same features.
    unsafe { tile_avx2::<1, 1>([w], [a])[0][0] }
}

/// AVX2 tile, `R` weight rows × `T` activation rows: a block's 16 code bytes widen to 32 unsigned
/// bytes (once per row, for all `T` tokens), and `vpmaddubsw` (codes ≤ 15, so pairs stay far
/// from i16 saturation) then `vpmaddwd` give the exact integer `Σ q·a` in 8 lanes; scales are
/// applied per block in f32 and the `m·(s·Σa)` terms summed on the side. Each product's
/// sequence is the same whatever `R` and `T` are.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn tile_avx2<const R: usize, const T: usize>(w: [Q4Row<'_>; R], a: [ActRow<'_>; T]) -> [[f32; T]; R] {
    let nb = blocks(&w, &a);
    let low4 = _mm_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut offsets = [[0f32; T]; R];
    // As in the VNNI tile: a later tile's scales and offsets now, its codes block by block.
    prefetch(w[0].1.as_ptr().wrapping_add(PREFETCH_TILES * R * nb), R * nb);
    prefetch(w[0].2.as_ptr().wrapping_add(PREFETCH_TILES * R * nb), R * nb);
    let ahead = w[0].0.as_ptr().wrapping_add(PREFETCH_TILES * R * nb * QK / 2);
    for b in 0..nb {
        prefetch(ahead.wrapping_add(b * R * QK / 2), R * QK / 2);
        // SAFETY: block b is inside every row (checked above).
        unsafe {
            let x: [__m256i; T] = std::array::from_fn(|t| _mm256_loadu_si256(a[t].0.as_ptr().add(b * QK).cast()));
            for r in 0..R {
                let (codes, d, m) = w[r];
                let y = _mm_loadu_si128(codes.as_ptr().add(b * QK / 2).cast());
                let lo = _mm_and_si128(y, low4);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(y), low4);
                let q = _mm256_set_m128i(hi, lo);
                let sw = _mm256_set1_ps(*d.get_unchecked(b));
                for t in 0..T {
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x[t]), ones);
                    let s = _mm256_mul_ps(sw, _mm256_set1_ps(*a[t].1.get_unchecked(b)));
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[r][t]);
                    offsets[r][t] += *m.get_unchecked(b) * *a[t].2.get_unchecked(b);
                }
            }
        }
    }
    std::array::from_fn(|r| std::array::from_fn(|t| super::f32::reduce8(acc[r][t]) + offsets[r][t]))
}

/// Blocks per row of a tile's operands; panics unless every row has that many (the tiles then
/// read them unchecked).
fn blocks<const R: usize, const T: usize>(w: &[Q4Row<'_>; R], a: &[ActRow<'_>; T]) -> usize {
    let nb = a[0].1.len();
    let weights_ok = w
        .iter()
        .all(|(c, d, m)| c.len() == nb * QK / 2 && d.len() == nb && m.len() == nb);
    let acts_ok = a
        .iter()
        .all(|(q, d, s)| q.len() == nb * QK && d.len() == nb && s.len() == nb);
    assert!(weights_ok && acts_ok, "Q4 tile: rows of different lengths");
    nb
}

/// Scalar reference tile: `R × T` independent [`dot_scalar`] products.
pub fn tile_scalar<const R: usize, const T: usize>(w: [Q4Row<'_>; R], a: [ActRow<'_>; T]) -> [[f32; T]; R] {
    std::array::from_fn(|r| std::array::from_fn(|t| dot_scalar(w[r], a[t])))
}

/// AVX-512 VNNI tile: two blocks per `vpdpbusd`, `R` weight rows × `T` activation rows.
///
/// The 32 code bytes of a block pair are loaded once into both halves of a register; shifting
/// the upper half by 4 and masking unpacks them to `[b lo | b' lo | b hi | b' hi]` (16 values per
/// 128-bit lane) in three instructions. The activations' 64 bytes are shuffled to the same lane
/// order once per token, so the unpacked codes need no shuffle per row. The `m·(s·Σa)` terms are
/// accumulated first, 16 blocks per FMA, rather than riding along every block pair: at one token
/// the tile is bound by instructions, not bytes. Every product follows the same instruction
/// sequence whatever `R` and `T` are, so results do not depend on the tile.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL/VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub unsafe fn tile_vnni512<const R: usize, const T: usize>(w: [Q4Row<'_>; R], a: [ActRow<'_>; T]) -> [[f32; T]; R] {
    let nb = blocks(&w, &a);
    let low4 = _mm512_set1_epi8(0x0f);
    // Per 64-bit lane: the lower half keeps the low nibbles, the upper half shifts the high ones down.
    let nibble_shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    // Scale lanes: 128-bit lanes 0 and 2 hold block b, lanes 1 and 3 block b + 1.
    let spread = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // Scales and offsets are streams of their own beside the codes: a later tile's, now.
    prefetch(w[0].1.as_ptr().wrapping_add(PREFETCH_TILES * R * nb), R * nb);
    prefetch(w[0].2.as_ptr().wrapping_add(PREFETCH_TILES * R * nb), R * nb);
    // The offsets Σ_b m_b·(s·Σa)_b, 16 blocks at a time.
    let mut b = 0;
    while b < nb {
        let k: u16 = if nb - b >= 16 { u16::MAX } else { (1u16 << (nb - b)) - 1 };
        // SAFETY: the mask selects blocks b..min(b + 16, nb), inside every slice (checked above).
        unsafe {
            let sums: [__m512; T] = std::array::from_fn(|t| _mm512_maskz_loadu_ps(k, a[t].2.as_ptr().add(b)));
            for r in 0..R {
                let m = _mm512_maskz_loadu_ps(k, w[r].2.as_ptr().add(b));
                for t in 0..T {
                    acc[r][t] = _mm512_fmadd_ps(m, sums[t], acc[r][t]);
                }
            }
        }
        b += 16;
    }
    let ahead = w[0].0.as_ptr().wrapping_add(PREFETCH_TILES * R * nb * QK / 2);
    let mut b = 0;
    while b < nb {
        let pair = b + 1 < nb;
        let act_mask: u64 = if pair { u64::MAX } else { u32::MAX as u64 };
        let two: u16 = if pair { 0b11 } else { 0b01 };
        prefetch(ahead.wrapping_add(b * R * QK / 2), R * QK);
        // SAFETY: blocks b and (if `pair`) b + 1 are inside every slice (checked above); masked
        // loads touch only the selected elements, and a pair's 32 code bytes are its own.
        unsafe {
            let mut av = [_mm512_setzero_si512(); T];
            let mut sa = [_mm512_setzero_ps(); T];
            for t in 0..T {
                let (q, d, _) = a[t];
                let x = _mm512_maskz_loadu_epi8(act_mask, q.as_ptr().add(b * QK).cast());
                av[t] = _mm512_shuffle_i64x2::<0b11_01_10_00>(x, x);
                sa[t] = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(two, d.as_ptr().add(b)));
            }
            for r in 0..R {
                let (c, d, _) = w[r];
                let at = c.as_ptr().add(b * QK / 2);
                let y = if pair {
                    _mm256_loadu_si256(at.cast())
                } else {
                    _mm256_maskz_loadu_epi8(u16::MAX as u32, at.cast())
                };
                let codes = _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(y), nibble_shift), low4);
                let sw = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(two, d.as_ptr().add(b)));
                for t in 0..T {
                    let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, av[t]);
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(sw, sa[t]), acc[r][t]);
                }
            }
        }
        b += 2;
    }
    reduce_tile(&acc)
}

/// Each accumulator of a tile summed across its 16 lanes, in one fixed order for every tile
/// shape.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn reduce_tile<const R: usize, const T: usize>(acc: &[[__m512; T]; R]) -> [[f32; T]; R] {
    std::array::from_fn(|r| std::array::from_fn(|t| _mm512_reduce_add_ps(acc[r][t])))
}

impl QuantizedRows {
    /// Row `i` with its block sums, for Q4 weights.
    #[inline]
    pub fn row_with_sums(&self, i: usize) -> ActRow<'_> {
        let (q, d) = self.row(i);
        let nb = self.cols / QK;
        (q, d, &self.sums[i * nb..(i + 1) * nb])
    }
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
    fn ggml_blocks_decode_like_the_shared_dequantizer() {
        for dtype in [DType::Q4_0, DType::Q4_1] {
            let (rows, cols) = (3, 64);
            let w = noise(rows * cols, 4, 2.0);
            let m = Q4Matrix::quantize(&w, rows, cols, dtype).unwrap();
            let bytes = match dtype {
                DType::Q4_0 => baton_shared::dtype::quantize_q4_0(&w),
                _ => baton_shared::dtype::quantize_q4_1(&w),
            };
            let mut want = vec![0f32; rows * cols];
            baton_shared::dtype::dequantize(dtype, &bytes, &mut want);
            let mut got = vec![0f32; cols];
            for r in 0..rows {
                m.dequantize_row(r, &mut got);
                for (g, w) in got.iter().zip(&want[r * cols..]) {
                    assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{dtype}: {g} vs {w}");
                }
            }
        }
        assert_eq!(
            Q4Matrix::from_ggml(DType::Q4_1, &[0; 10], 1, 32),
            Err(Q4Error::Bytes {
                dtype: DType::Q4_1,
                got: 10,
                want: 20,
                rows: 1,
                cols: 32
            })
        );
        assert_eq!(
            Q4Matrix::from_ggml(DType::Q8_0, &[], 0, 32),
            Err(Q4Error::NotQ4(DType::Q8_0))
        );
    }

    #[test]
    fn scalar_dot_equals_the_dequantized_product_up_to_activation_rounding() {
        let cols = 96;
        let w = Q4Matrix::quantize(&noise(cols, 1, 1.0), 1, cols, DType::Q4_1).unwrap();
        let x = noise(cols, 2, 1.0);
        let mut xq = QuantizedRows::default();
        xq.quantize(&x, cols);
        let mut wf = vec![0f32; cols];
        w.dequantize_row(0, &mut wf);
        // The same product with the activations' rounding: exact up to f32 summation.
        let xr: Vec<f32> = (0..cols).map(|j| xq.quants[j] as f32 * xq.scales[j / QK]).collect();
        let want: f32 = wf.iter().zip(&xr).map(|(a, b)| a * b).sum();
        let got = dot_scalar(w.row(0), xq.row_with_sums(0));
        let mag: f32 = wf.iter().zip(&xr).map(|(a, b)| (a * b).abs()).sum();
        assert!((got - want).abs() <= 1e-5 * mag, "{got} vs {want}");
    }

    #[test]
    fn every_row_kernel_matches_the_scalar_twin() {
        let mut paths = PathsRun::new("kernels::cpu::q4::tests::every_row_kernel_matches_the_scalar_twin");
        for dtype in [DType::Q4_0, DType::Q4_1] {
            for cols in [32, 96, 576] {
                let w = Q4Matrix::quantize(&noise(cols, 21, 3.0), 1, cols, dtype).unwrap();
                let mut x = noise(cols, 22, 1.0);
                x[cols - 1] = -1.0;
                let mut xq = QuantizedRows::default();
                xq.quantize(&x, cols);
                let want = dot_scalar(w.row(0), xq.row_with_sums(0));
                let mut wf = vec![0f32; cols];
                w.dequantize_row(0, &mut wf);
                let mag: f32 = (0..cols)
                    .map(|j| (wf[j] * xq.quants[j] as f32 * xq.scales[j / QK]).abs())
                    .sum();
                for k in Kernels::all_supported() {
                    paths.record(k.path());
                    let got = dot(k, w.row(0), xq.row_with_sums(0));
                    assert!(
                        (got - want).abs() <= 1e-5 * mag,
                        "{dtype} {} cols={cols}: {got} vs {want}",
                        k.path()
                    );
                }
            }
        }
        paths.check(&KernelPath::ALL);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_tile_matches_the_scalar_twin_and_is_independent_of_the_tile_shape() {
        let test = "kernels::cpu::q4::tests::vnni_tile_matches_the_scalar_twin_and_is_independent_of_the_tile_shape";
        if !crate::kernels::cpu::paths_run::require(test, KernelPath::Avx512Vnni) {
            return;
        }
        // SAFETY: checked above.
        check_tile(
            |w, a| unsafe { tile_vnni512(w, a) },
            |w, a| unsafe { tile_vnni512::<1, 1>(w, a) },
        );
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_tile_matches_the_scalar_twin_and_is_independent_of_the_tile_shape() {
        let test = "kernels::cpu::q4::tests::avx2_tile_matches_the_scalar_twin_and_is_independent_of_the_tile_shape";
        if !crate::kernels::cpu::paths_run::require(test, KernelPath::Avx2) {
            return;
        }
        // SAFETY: checked above.
        check_tile(
            |w, a| unsafe { tile_avx2(w, a) },
            |w, a| {
                // SAFETY: as above; the row kernel is the 1 × 1 tile.
                let (row, tile) = unsafe { (dot_avx2(w[0], a[0]), tile_avx2::<1, 1>(w, a)) };
                assert_eq!(row.to_bits(), tile[0][0].to_bits());
                tile
            },
        );
    }

    /// A 4 × 4 tile against the scalar twin, and each of its products bit-identical alone.
    fn check_tile(
        four: fn([Q4Row<'_>; 4], [ActRow<'_>; 4]) -> [[f32; 4]; 4],
        one: fn([Q4Row<'_>; 1], [ActRow<'_>; 1]) -> [[f32; 1]; 1],
    ) {
        for dtype in [DType::Q4_0, DType::Q4_1] {
            // 1, 3 (odd: a lone last block) and 18 blocks; tiny, huge and mixed magnitudes.
            for cols in [32, 96, 576] {
                for (seed, scale) in [(1u64, 1.0f32), (2, 1e3), (3, 1e-5)] {
                    let w = Q4Matrix::quantize(&noise(4 * cols, seed, scale), 4, cols, dtype).unwrap();
                    let mut x = noise(4 * cols, seed + 7, 1.0);
                    x[0] = 0.0;
                    x[cols - 1] = -1.0; // the extreme quant -127
                    let mut xq = QuantizedRows::default();
                    xq.quantize(&x, cols);
                    let wr: [_; 4] = std::array::from_fn(|r| w.row(r));
                    let ar: [_; 4] = std::array::from_fn(|t| xq.row_with_sums(t));
                    let want = tile_scalar(wr, ar);
                    let got = four(wr, ar);
                    for r in 0..4 {
                        for t in 0..4 {
                            let mag: f32 = {
                                let mut wf = vec![0f32; cols];
                                w.dequantize_row(r, &mut wf);
                                (0..cols)
                                    .map(|j| {
                                        (wf[j] * xq.quants[t * cols + j] as f32 * xq.scales[t * cols / QK + j / QK])
                                            .abs()
                                    })
                                    .sum()
                            };
                            let (g, e) = (got[r][t], want[r][t]);
                            assert!(
                                (g - e).abs() <= 1e-5 * mag,
                                "{dtype} cols={cols} r={r} t={t}: {g} vs {e}"
                            );
                            let one = one([wr[r]], [ar[t]]);
                            assert_eq!(one[0][0].to_bits(), g.to_bits(), "{dtype} cols={cols} r={r} t={t}");
                        }
                    }
                }
            }
        }
    }
}
