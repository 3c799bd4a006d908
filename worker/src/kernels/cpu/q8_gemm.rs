//! Q8_0 matrix-matrix tile: `R` weight rows × `T` activation rows per call, so each weight
//! block loaded from cache feeds `T` products and each activation block feeds `R`.
//!
//! Why a separate kernel from [`super::q8::dot_vnni_rows`]: prefill and batched decode are
//! compute-bound, and there the row-at-a-time kernel spends ~7 instructions per 32-value block
//! product. This one uses 512-bit `vpdpbusd` over two blocks at once and needs ~2.5:
//!
//! * activations are made unsigned by flipping their top bit (`a + 128`), so no per-product sign
//!   fix-up is needed; the extra `128·Σw` per 4-byte lane is computed once per weight row and
//!   block pair (`vpdpbusd` of 128s with `w`) and pre-loaded as the negative accumulator, so each
//!   lane is still the exact integer `Σ a·w`;
//! * the two blocks' scale products are spread over the low and high 8 lanes with one
//!   `vpermps` per row and per token, then one multiply and one FMA per product.
//!
//! Every (row, token) product follows the same instruction sequence whatever `R` and `T` are,
//! so a row's result does not depend on how many other rows or tokens share its tile: a
//! sequence decoded alone and inside a batch gets bit-identical logits.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::{PREFETCH_TILES, prefetch};

use baton_shared::dtype::QK;

/// Scalar reference twin of [`tile_vnni512`]: each product as in [`super::q8::dot_scalar`].
pub fn tile_scalar<const R: usize, const T: usize>(
    wq: [&[i8]; R],
    wd: [&[f32]; R],
    aq: [&[i8]; T],
    ad: [&[f32]; T],
) -> [[f32; T]; R] {
    std::array::from_fn(|r| std::array::from_fn(|t| super::q8::dot_scalar(wq[r], wd[r], aq[t], ad[t])))
}

/// Blocks per row of a tile's operands; panics unless every row has that many (the tiles then
/// read them unchecked).
fn blocks<const R: usize, const T: usize>(
    wq: &[&[i8]; R],
    wd: &[&[f32]; R],
    aq: &[&[i8]; T],
    ad: &[&[f32]; T],
) -> usize {
    let nb = ad[0].len();
    let weights_ok = (0..R).all(|r| wq[r].len() == nb * QK && wd[r].len() == nb);
    let acts_ok = (0..T).all(|t| aq[t].len() == nb * QK && ad[t].len() == nb);
    assert!(weights_ok && acts_ok, "Q8_0 tile: rows of different lengths");
    nb
}

/// AVX-512 VNNI tile (see the module docs). Every slice holds the same number of blocks.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL/VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub unsafe fn tile_vnni512<const R: usize, const T: usize>(
    wq: [&[i8]; R],
    wd: [&[f32]; R],
    aq: [&[i8]; T],
    ad: [&[f32]; T],
) -> [[f32; T]; R] {
    let nb = blocks(&wq, &wd, &aq, &ad);
    let flip = _mm512_set1_epi8(-128);
    let zero = _mm512_setzero_si512();
    // Lanes 0..8 take the first block's scale, lanes 8..16 the second's.
    let spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // Rows of a matrix are contiguous: a later tile's scales now, its quants block by block.
    prefetch(wd[0].as_ptr().wrapping_add(PREFETCH_TILES * R * nb), R * nb);
    let ahead = wq[0].as_ptr().wrapping_add(PREFETCH_TILES * R * nb * QK);
    let mut b = 0;
    while b < nb {
        // Two blocks, or the last one alone (upper half zero: zero weights add exact zeros).
        let pair = b + 1 < nb;
        let bytes_mask: u64 = if pair { u64::MAX } else { u32::MAX as u64 };
        let scale_mask: u16 = if pair { 0b11 } else { 0b01 };
        prefetch(ahead.wrapping_add(b * R * QK), R * 2 * QK);
        // SAFETY: blocks b and (if `pair`) b + 1 are inside every slice (checked above); masked
        // loads touch only the selected bytes.
        unsafe {
            let mut ua = [zero; T];
            let mut sa = [_mm512_setzero_ps(); T];
            for t in 0..T {
                let a = _mm512_maskz_loadu_epi8(bytes_mask, aq[t].as_ptr().add(b * QK).cast());
                // a + 128 as unsigned; a zero-padded upper half becomes 128, times zero weights.
                ua[t] = _mm512_xor_si512(a, flip);
                let s = _mm512_maskz_loadu_ps(scale_mask, ad[t].as_ptr().add(b));
                sa[t] = _mm512_permutexvar_ps(spread, s);
            }
            for r in 0..R {
                let w = _mm512_maskz_loadu_epi8(bytes_mask, wq[r].as_ptr().add(b * QK).cast());
                let bias = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, w));
                let sw = _mm512_maskz_loadu_ps(scale_mask, wd[r].as_ptr().add(b));
                let sw = _mm512_permutexvar_ps(spread, sw);
                for t in 0..T {
                    let p = _mm512_dpbusd_epi32(bias, ua[t], w);
                    let d = _mm512_mul_ps(sw, sa[t]);
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), d, acc[r][t]);
                }
            }
        }
        b += 2;
    }
    reduce_tile(&acc)
}

/// AVX2 tile: per product, per block, `vpsignb` + `vpmaddubsw` + `vpmaddwd` (the exact integer
/// block sum, as [`super::q8::dot_avx2`] computes it), then the two scales' product and one FMA
/// into that product's accumulator. Each weight block is loaded once for the `T` tokens and each
/// activation block (and its `|a|`) once for the `R` rows, which is what makes it faster than
/// the row kernel; the per-product sequence does not depend on `R` or `T`, and
/// [`super::q8::dot_avx2`] is this tile at `1 × 1`.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn tile_avx2<const R: usize, const T: usize>(
    wq: [&[i8]; R],
    wd: [&[f32]; R],
    aq: [&[i8]; T],
    ad: [&[f32]; T],
) -> [[f32; T]; R] {
    let nb = blocks(&wq, &wd, &aq, &ad);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // As in the VNNI tile: R rows read side by side defeat the hardware streamers in decode.
    prefetch(wd[0].as_ptr().wrapping_add(PREFETCH_TILES * R * nb), R * nb);
    let ahead = wq[0].as_ptr().wrapping_add(PREFETCH_TILES * R * nb * QK);
    for b in 0..nb {
        prefetch(ahead.wrapping_add(b * R * QK), R * QK);
        // SAFETY: block b is inside every slice (checked above).
        unsafe {
            let a: [__m256i; T] = std::array::from_fn(|t| _mm256_loadu_si256(aq[t].as_ptr().add(b * QK).cast()));
            let ua = a.map(|a| _mm256_abs_epi8(a));
            for r in 0..R {
                let w = _mm256_loadu_si256(wq[r].as_ptr().add(b * QK).cast());
                let sw = _mm256_set1_ps(*wd[r].get_unchecked(b));
                for t in 0..T {
                    // w with a's sign: |a|·(±w) = a·w, pairs at most 2·127·127 (no saturation).
                    let p16 = _mm256_maddubs_epi16(ua[t], _mm256_sign_epi8(w, a[t]));
                    let p32 = _mm256_madd_epi16(p16, ones);
                    let d = _mm256_mul_ps(sw, _mm256_set1_ps(*ad[t].get_unchecked(b)));
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), d, acc[r][t]);
                }
            }
        }
    }
    std::array::from_fn(|r| std::array::from_fn(|t| super::f32::reduce8(acc[r][t])))
}

/// Each accumulator of a tile summed across its 16 lanes, in one fixed order for every tile
/// kernel and shape.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) fn reduce_tile<const R: usize, const T: usize>(acc: &[[__m512; T]; R]) -> [[f32; T]; R] {
    std::array::from_fn(|r| std::array::from_fn(|t| _mm512_reduce_add_ps(acc[r][t])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::q8::{Q8Matrix, QuantizedRows};

    fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        crate::kernels::cpu::f32::tests::noise(n, seed, scale)
    }

    #[cfg(target_arch = "x86_64")]
    fn vnni() -> bool {
        crate::kernels::cpu::dispatch::KernelPath::Avx512Vnni.is_supported()
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_tile_matches_the_scalar_twin_and_is_independent_of_the_tile_shape() {
        if !vnni() {
            eprintln!("no AVX-512 VNNI here: nothing to compare");
            return;
        }
        // SAFETY: checked above.
        check_tile(
            |wq, wd, aq, ad| unsafe { tile_vnni512(wq, wd, aq, ad) },
            |wq, wd, aq, ad| unsafe { tile_vnni512::<1, 1>(wq, wd, aq, ad) },
            |wq, wd, aq, ad| unsafe { tile_vnni512::<2, 3>(wq, wd, aq, ad) },
        );
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_tile_matches_the_scalar_twin_and_the_row_kernel_and_is_independent_of_the_tile_shape() {
        if !crate::kernels::cpu::dispatch::KernelPath::Avx2.is_supported() {
            eprintln!("no AVX2 here: nothing to compare");
            return;
        }
        // SAFETY: checked above.
        check_tile(
            |wq, wd, aq, ad| unsafe { tile_avx2(wq, wd, aq, ad) },
            |wq, wd, aq, ad| {
                // SAFETY: as above; the row kernel is the 1 × 1 tile.
                let row = unsafe { crate::kernels::cpu::q8::dot_avx2(wq[0], wd[0], aq[0], ad[0]) };
                // SAFETY: as above.
                let tile = unsafe { tile_avx2::<1, 1>(wq, wd, aq, ad) };
                assert_eq!(row.to_bits(), tile[0][0].to_bits());
                tile
            },
            |wq, wd, aq, ad| unsafe { tile_avx2::<2, 3>(wq, wd, aq, ad) },
        );
    }

    type Tile<const R: usize, const T: usize> = fn([&[i8]; R], [&[f32]; R], [&[i8]; T], [&[f32]; T]) -> [[f32; T]; R];

    /// A tile kernel against the scalar twin (within the f32 accumulation-order tolerance), and
    /// each of its products bit-identical in other tile shapes.
    fn check_tile(four: Tile<4, 4>, one: Tile<1, 1>, two_by_three: Tile<2, 3>) {
        // 1, 3 (odd: a lone last block) and 18 blocks; tiny, huge and mixed magnitudes.
        for cols in [32, 96, 576] {
            for (seed, scale) in [(1u64, 1.0f32), (2, 1e3), (3, 1e-5)] {
                let w = Q8Matrix::quantize(&noise(4 * cols, seed, scale), 4, cols).unwrap();
                let mut x = noise(4 * cols, seed + 7, 1.0);
                x[0] = 0.0;
                x[cols - 1] = -1.0; // the extreme quant -127
                x[cols] = 1.0; // +127
                let mut xq = QuantizedRows::default();
                xq.quantize(&x, cols);
                let wr: [_; 4] = std::array::from_fn(|r| w.row(r));
                let ar: [_; 4] = std::array::from_fn(|t| xq.row(t));
                let (wq, wd) = (wr.map(|r| r.0), wr.map(|r| r.1));
                let (aq, ad) = (ar.map(|a| a.0), ar.map(|a| a.1));
                let want = tile_scalar(wq, wd, aq, ad);
                let got = four(wq, wd, aq, ad);
                for r in 0..4 {
                    for t in 0..4 {
                        // Integer block sums are exact; only the f32 accumulation order differs.
                        let mag: f32 = (0..cols / QK)
                            .map(|b| {
                                let s: i32 = (b * QK..(b + 1) * QK)
                                    .map(|j| (wq[r][j] as i32 * aq[t][j] as i32).abs())
                                    .sum();
                                (wd[r][b] * ad[t][b]).abs() * s as f32
                            })
                            .sum();
                        let (g, w) = (got[r][t], want[r][t]);
                        assert!((g - w).abs() <= 1e-6 * mag, "cols={cols} r={r} t={t}: {g} vs {w}");
                        // The same product in any other tile shape is bit-identical.
                        let one = one([wq[r]], [wd[r]], [aq[t]], [ad[t]]);
                        assert_eq!(one[0][0].to_bits(), g.to_bits(), "cols={cols} r={r} t={t}");
                    }
                }
                let two_by_three = two_by_three(
                    [wq[1], wq[2]],
                    [wd[1], wd[2]],
                    [aq[0], aq[1], aq[3]],
                    [ad[0], ad[1], ad[3]],
                );
                assert_eq!(two_by_three[1][2].to_bits(), got[2][3].to_bits());
            }
        }
    }
}
