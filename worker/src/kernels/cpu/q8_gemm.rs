//! Q8_0 panel products: one panel of 16 weight rows against `T` quantized activation rows, for
//! decode (`T = 1`), batched decode and prefill alike.
//!
//! The layout ([`super::q8`]) puts four columns of sixteen rows in one 64-byte vector, so a
//! block of a panel is eight such vectors, and for each token:
//!
//! * eight `vpdpbusd`, each against four of the token's activation bytes broadcast to every lane,
//!   add a block's products into sixteen row sums at once. The sums start at the activation
//!   block's `-128·Σa`, which cancels the weights' `+128` bias, so each lane ends as the exact
//!   integer `Σ w·a`;
//! * one convert, one multiply (weight scales × the token's scale) and one FMA fold the block
//!   into the token's f32 row accumulators, in block order.
//!
//! That is 11 vector instructions per 512 multiply-adds, against ~60 for the row-at-a-time
//! tiles it replaced, which reduced a sum per row and multiplied scales per row and block.
//! Weight vectors are loaded once per block and reused by the `T` tokens.
//!
//! Each (row, token) result is the same sequence of exact integer block sums and f32
//! `fma(sum, w_scale · a_scale, acc)` steps on every path and for every `T`, so all paths, tile
//! sizes and thread counts give bit-identical results, equal to [`panel_scalar`]: a sequence
//! decoded alone and inside a batch gets the same logits.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use baton_shared::dtype::QK;

use super::q8::{PANEL, PANEL_BLOCK, Panel, Q8Act};

/// Blocks of quants each panel kernel prefetches ahead of the one it multiplies. A panel's
/// blocks are contiguous and panels follow each other, so this runs on into the next panel;
/// 4 blocks (2 KiB) covers the latency of the first lines of a thread's next panel.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BLOCKS: usize = 4;

/// Blocks ahead (16 KiB) each panel kernel also hints into L2. A stage's weights stream from
/// memory every step, and at batched-decode sizes (8 tokens) the L1 prefetch alone
/// left the DRAM reads and the `vpdpbusd` work taking turns instead of overlapping: on a Zen 4
/// core a pass over 18 layers at 8 tokens took 879 µs a token without it and 666–707 with it
/// 24–48 blocks ahead (`baton-bench kernels --layers 18`, docs/benchmarks.md).
#[cfg(target_arch = "x86_64")]
const PREFETCH_L2_BLOCKS: usize = 32;

/// Hint block `b + PREFETCH_BLOCKS` of a panel into L1 and block `b + PREFETCH_L2_BLOCKS` into
/// L2 (quants and scales). The addresses may run past the matrix: hints never fault.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(wq: *const u8, wd: *const f32, b: usize) {
    super::prefetch(wq.wrapping_add((b + PREFETCH_BLOCKS) * PANEL_BLOCK), PANEL_BLOCK);
    super::prefetch(wd.wrapping_add((b + PREFETCH_BLOCKS) * PANEL), PANEL);
    super::prefetch_l2(wq.wrapping_add((b + PREFETCH_L2_BLOCKS) * PANEL_BLOCK), PANEL_BLOCK);
    super::prefetch_l2(wd.wrapping_add((b + PREFETCH_L2_BLOCKS) * PANEL), PANEL);
}

/// Blocks per row, after checking that the panel and every activation row agree on it (the
/// SIMD kernels then read unchecked).
fn blocks<const T: usize>(w: &Panel<'_>, a: &[Q8Act<'_>; T]) -> usize {
    let nb = w.scales.len() / PANEL;
    let weights_ok = w.quants.len() == nb * PANEL_BLOCK && w.scales.len() == nb * PANEL;
    let acts_ok = a
        .iter()
        .all(|a| a.quants.len() == nb * QK && a.scales.len() == nb && a.bias.len() == nb);
    assert!(weights_ok && acts_ok, "Q8_0 panel: operands of different lengths");
    nb
}

/// Scalar reference twin: `out[t][i]` = row `i` of the panel · activation row `t`.
pub fn panel_scalar<const T: usize>(w: Panel<'_>, a: [Q8Act<'_>; T]) -> [[f32; PANEL]; T] {
    let nb = blocks(&w, &a);
    std::array::from_fn(|t| {
        std::array::from_fn(|i| {
            let mut acc = 0f32;
            for b in 0..nb {
                let mut p = a[t].bias[b];
                for j in 0..QK {
                    let wq = w.quants[b * PANEL_BLOCK + (j / 4) * (4 * PANEL) + i * 4 + j % 4];
                    p += wq as i32 * a[t].quants[b * QK + j] as i32;
                }
                acc = (p as f32).mul_add(w.scales[b * PANEL + i] * a[t].scales[b], acc);
            }
            acc
        })
    })
}

/// AVX-512 VNNI panel kernel (see the module docs). Two integer chains per token (even and odd
/// column groups) halve the `vpdpbusd` latency chain; integer sums are exact, so the split does
/// not change a bit.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL/VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub unsafe fn panel_vnni512<const T: usize>(w: Panel<'_>, a: [Q8Act<'_>; T]) -> [[f32; PANEL]; T] {
    let nb = blocks(&w, &a);
    let (wq, wd) = (w.quants.as_ptr(), w.scales.as_ptr());
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..nb {
        prefetch_ahead(wq, wd, b);
        // SAFETY: block b is inside the panel and every activation row (checked above).
        unsafe {
            let mut even: [__m512i; T] = std::array::from_fn(|t| _mm512_set1_epi32(*a[t].bias.get_unchecked(b)));
            let mut odd = [_mm512_setzero_si512(); T];
            for g in (0..QK / 4).step_by(2) {
                let base = wq.add(b * PANEL_BLOCK + g * 4 * PANEL);
                let w0 = _mm512_loadu_si512(base.cast());
                let w1 = _mm512_loadu_si512(base.add(4 * PANEL).cast());
                for t in 0..T {
                    let x = a[t].quants.as_ptr().add(b * QK + 4 * g).cast::<i32>();
                    even[t] = _mm512_dpbusd_epi32(even[t], w0, _mm512_set1_epi32(x.read_unaligned()));
                    odd[t] = _mm512_dpbusd_epi32(odd[t], w1, _mm512_set1_epi32(x.add(1).read_unaligned()));
                }
            }
            let s = _mm512_loadu_ps(wd.add(b * PANEL));
            for t in 0..T {
                let p = _mm512_cvtepi32_ps(_mm512_add_epi32(even[t], odd[t]));
                let d = _mm512_mul_ps(s, _mm512_set1_ps(*a[t].scales.get_unchecked(b)));
                acc[t] = _mm512_fmadd_ps(p, d, acc[t]);
            }
        }
    }
    acc.map(|v| {
        let mut out = [0f32; PANEL];
        // SAFETY: `out` holds 16 f32.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) };
        out
    })
}

/// AVX-VNNI panel kernel (256-bit VEX `vpdpbusd`, for CPUs with VNNI but no AVX-512): the
/// AVX-512 VNNI kernel's arithmetic on two 8-row halves, so the same bits.
///
/// # Safety
/// The CPU must support AVX2, FMA and AVX-VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avxvnni")]
pub unsafe fn panel_avxvnni<const T: usize>(w: Panel<'_>, a: [Q8Act<'_>; T]) -> [[f32; PANEL]; T] {
    let nb = blocks(&w, &a);
    let (wq, wd) = (w.quants.as_ptr(), w.scales.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 2]; T];
    for b in 0..nb {
        prefetch_ahead(wq, wd, b);
        // SAFETY: block b is inside the panel and every activation row (checked above).
        unsafe {
            let mut sums: [[__m256i; 2]; T] =
                std::array::from_fn(|t| [_mm256_set1_epi32(*a[t].bias.get_unchecked(b)); 2]);
            for g in 0..QK / 4 {
                let base = wq.add(b * PANEL_BLOCK + g * 4 * PANEL);
                let w = [0, 32].map(|o| _mm256_loadu_si256(base.add(o).cast()));
                for t in 0..T {
                    let x = a[t].quants.as_ptr().add(b * QK + 4 * g).cast::<i32>();
                    let x = _mm256_set1_epi32(x.read_unaligned());
                    for h in 0..2 {
                        sums[t][h] = _mm256_dpbusd_avx_epi32(sums[t][h], w[h], x);
                    }
                }
            }
            fold_block_256(&mut acc, &sums, wd.add(b * PANEL), &a, b);
        }
    }
    store_256(acc)
}

/// AVX2 panel kernel: the same integer block sums without VNNI, eight rows per 256-bit half.
/// Weights are un-biased (`xor 0x80`) and given the activation's sign (`vpsignb`) so that
/// `vpmaddubsw` multiplies |a| by ±w with pairs of at most 2·127·127 (no saturation; this is why
/// -128 quants are clamped at load), then `vpmaddwd` adds pairs into the row's lane. No bias
/// correction is needed: the sums are `Σ w·a` directly.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn panel_avx2<const T: usize>(w: Panel<'_>, a: [Q8Act<'_>; T]) -> [[f32; PANEL]; T] {
    let nb = blocks(&w, &a);
    let (wq, wd) = (w.quants.as_ptr(), w.scales.as_ptr());
    let flip = _mm256_set1_epi8(i8::MIN);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; T];
    for b in 0..nb {
        prefetch_ahead(wq, wd, b);
        // SAFETY: block b is inside the panel and every activation row (checked above).
        unsafe {
            let mut sums = [[_mm256_setzero_si256(); 2]; T];
            for g in 0..QK / 4 {
                let base = wq.add(b * PANEL_BLOCK + g * 4 * PANEL);
                let w = [0, 32].map(|o| _mm256_xor_si256(_mm256_loadu_si256(base.add(o).cast()), flip));
                for t in 0..T {
                    let x = a[t].quants.as_ptr().add(b * QK + 4 * g).cast::<i32>();
                    let x = _mm256_set1_epi32(x.read_unaligned());
                    let ux = _mm256_abs_epi8(x);
                    for h in 0..2 {
                        let p16 = _mm256_maddubs_epi16(ux, _mm256_sign_epi8(w[h], x));
                        sums[t][h] = _mm256_add_epi32(sums[t][h], _mm256_madd_epi16(p16, ones));
                    }
                }
            }
            fold_block_256(&mut acc, &sums, wd.add(b * PANEL), &a, b);
        }
    }
    store_256(acc)
}

/// Fold one block's integer row sums (two 8-row halves per token) into the f32 accumulators of
/// the 256-bit kernels: `acc += sum · (w_scale · a_scale)`, as every path does.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `wd` must point at the block's 16 weight scales and every
/// activation row must hold block `b`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn fold_block_256<const T: usize>(
    acc: &mut [[__m256; 2]; T],
    sums: &[[__m256i; 2]; T],
    wd: *const f32,
    a: &[Q8Act<'_>; T],
    b: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        let s = [0, 8].map(|o| _mm256_loadu_ps(wd.add(o)));
        for t in 0..T {
            let x = _mm256_set1_ps(*a[t].scales.get_unchecked(b));
            for h in 0..2 {
                let d = _mm256_mul_ps(s[h], x);
                acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t][h]), d, acc[t][h]);
            }
        }
    }
}

/// The 256-bit kernels' accumulators as 16 row results per token.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn store_256<const T: usize>(acc: [[__m256; 2]; T]) -> [[f32; PANEL]; T] {
    acc.map(|v| {
        let mut out = [0f32; PANEL];
        // SAFETY: `out` holds 16 f32.
        unsafe {
            _mm256_storeu_ps(out.as_mut_ptr(), v[0]);
            _mm256_storeu_ps(out.as_mut_ptr().add(8), v[1]);
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::dispatch::KernelPath;
    use crate::kernels::cpu::paths_run::PathsRun;
    use crate::kernels::cpu::q8::{Q8Matrix, QuantizedRows};

    fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        crate::kernels::cpu::f32::tests::noise(n, seed, scale)
    }

    /// Every kernel this CPU runs, by name, at a tile of 3 tokens and of 1.
    #[allow(clippy::type_complexity)]
    fn kernels() -> Vec<(
        KernelPath,
        fn(Panel<'_>, [Q8Act<'_>; 3]) -> [[f32; PANEL]; 3],
        fn(Panel<'_>, [Q8Act<'_>; 1]) -> [[f32; PANEL]; 1],
    )> {
        #[allow(unused_mut)]
        let mut v: Vec<(
            KernelPath,
            fn(Panel<'_>, [Q8Act<'_>; 3]) -> [[f32; PANEL]; 3],
            fn(Panel<'_>, [Q8Act<'_>; 1]) -> [[f32; PANEL]; 1],
        )> = vec![(KernelPath::Scalar, panel_scalar::<3>, panel_scalar::<1>)];
        #[cfg(target_arch = "x86_64")]
        {
            if KernelPath::Avx2.is_supported() {
                // SAFETY: checked just above.
                v.push((
                    KernelPath::Avx2,
                    |w, a| unsafe { panel_avx2(w, a) },
                    |w, a| unsafe { panel_avx2(w, a) },
                ));
            }
            if KernelPath::AvxVnni.is_supported() {
                // SAFETY: checked just above.
                v.push((
                    KernelPath::AvxVnni,
                    |w, a| unsafe { panel_avxvnni(w, a) },
                    |w, a| unsafe { panel_avxvnni(w, a) },
                ));
            }
            if KernelPath::Avx512Vnni.is_supported() {
                // SAFETY: checked just above.
                v.push((
                    KernelPath::Avx512Vnni,
                    |w, a| unsafe { panel_vnni512(w, a) },
                    |w, a| unsafe { panel_vnni512(w, a) },
                ));
            }
        }
        v
    }

    /// The exact product of the dequantized operands, in f64.
    fn exact(m: &Q8Matrix, r: usize, xq: &QuantizedRows, t: usize) -> f64 {
        terms(m, r, xq, t).sum()
    }

    /// The products of row `r` and activation row `t`, column by column, in f64.
    fn terms<'a>(m: &'a Q8Matrix, r: usize, xq: &'a QuantizedRows, t: usize) -> impl Iterator<Item = f64> + 'a {
        let (aq, ad) = xq.row(t);
        (0..m.cols).map(move |c| m.quant(r, c) as f64 * m.scale(r, c / QK) as f64 * aq[c] as f64 * ad[c / QK] as f64)
    }

    #[test]
    fn every_path_equals_the_scalar_twin_bit_for_bit_and_the_exact_product_closely() {
        let mut paths = PathsRun::new(
            "kernels::cpu::q8_gemm::tests::every_path_equals_the_scalar_twin_bit_for_bit_and_the_exact_product_closely",
        );
        for cols in [32, 64, 96, 576, 1536] {
            for (seed, scale) in [(1u64, 1.0f32), (2, 1e3), (3, 1e-5)] {
                let m = Q8Matrix::quantize(&noise(20 * cols, seed, scale), 20, cols).unwrap();
                let mut x = noise(3 * cols, seed + 7, 1.0);
                x[0] = 0.0;
                x[cols - 1] = -1.0; // the extreme quant -127
                x[cols..cols + QK].fill(0.0); // a zero block: scale 0
                let mut xq = QuantizedRows::default();
                xq.quantize(&x, cols);
                let acts = [0, 1, 2].map(|t| xq.q8_act(t));
                for p in 0..m.panels() {
                    let want = panel_scalar(m.panel(p), acts);
                    for (name, three, one) in kernels() {
                        paths.record(name);
                        assert_eq!(three(m.panel(p), acts), want, "{name} cols={cols} panel {p}");
                        for t in 0..3 {
                            assert_eq!(one(m.panel(p), [acts[t]])[0], want[t], "{name} alone, token {t}");
                        }
                    }
                    for (t, row) in want.iter().enumerate() {
                        for (i, &got) in row.iter().enumerate().take(m.rows.saturating_sub(p * PANEL)) {
                            let e = exact(&m, p * PANEL + i, &xq, t);
                            let mag: f64 = terms(&m, p * PANEL + i, &xq, t).map(f64::abs).sum();
                            // Only f32 rounding of each block's scaled sum and of the running
                            // total: a few ulps of the magnitude.
                            assert!((got as f64 - e).abs() <= 1e-6 * mag + 1e-30, "{got} vs {e}");
                        }
                        // Padding rows are exact zeros.
                        for &v in &row[m.rows.saturating_sub(p * PANEL).min(PANEL)..] {
                            assert_eq!(v, 0.0);
                        }
                    }
                }
            }
        }
        paths.check(&[
            KernelPath::Scalar,
            KernelPath::Avx2,
            KernelPath::AvxVnni,
            KernelPath::Avx512Vnni,
        ]);
    }

    #[test]
    fn extreme_quants_do_not_overflow_on_any_path() {
        // Every product 127·127 (and -127·127) in every block: the largest integer sums.
        let cols = 4 * QK;
        let mut bytes = Vec::new();
        for r in 0..PANEL {
            for _ in 0..cols / QK {
                bytes.extend_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
                bytes.extend((0..QK).map(|j| if (j + r) % 3 == 0 { 0x81u8 } else { 127 }));
            }
        }
        let m = Q8Matrix::from_ggml(&bytes, PANEL, cols).unwrap();
        // ±127 quantizes to quants ±127 with scale exactly 1, so every sum below is exact.
        let x: Vec<f32> = (0..3 * cols).map(|j| if j % 2 == 0 { 127.0 } else { -127.0 }).collect();
        let mut xq = QuantizedRows::default();
        xq.quantize(&x, cols);
        let acts = [0, 1, 2].map(|t| xq.q8_act(t));
        let want = panel_scalar(m.panel(0), acts);
        let mut paths = PathsRun::new("kernels::cpu::q8_gemm::tests::extreme_quants_do_not_overflow_on_any_path");
        for (name, three, _) in kernels() {
            paths.record(name);
            assert_eq!(three(m.panel(0), acts), want, "{name}");
        }
        for (i, &v) in want[0].iter().enumerate() {
            assert_eq!(v as f64, exact(&m, i, &xq, 0), "row {i}");
        }
        paths.check(&[
            KernelPath::Scalar,
            KernelPath::Avx2,
            KernelPath::AvxVnni,
            KernelPath::Avx512Vnni,
        ]);
    }
}
