//! f32 dot products, SIMD twins of [`reference::dot`].
//!
//! They reproduce the reference's arithmetic exactly: 16 lanes of partial sums, each updated
//! with a separate multiply and add (no FMA: a fused multiply-add rounds once instead of twice),
//! the same pairwise lane reduction and the same sequential tail. So the fast f32 path gives
//! bit-identical logits to the reference path, and parity with transformers carries over.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::dispatch::{KernelPath, Kernels};
use super::reference;

/// Dot product on the given path; bit-identical to [`reference::dot`] on every path.
#[inline]
pub fn dot(k: Kernels, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: length mismatch");
    match k.path() {
        KernelPath::Scalar => reference::dot(a, b),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels` is only made for paths the CPU supports.
        KernelPath::Avx2 | KernelPath::AvxVnni => unsafe { dot_avx2(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        KernelPath::Avx512 | KernelPath::Avx512Vnni => unsafe { dot_avx512(a, b) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => reference::dot(a, b),
    }
}

/// [`dot`] of `a` with each of 8 rows (attention scores: one query against 8 keys), bit for
/// bit: on AVX-512 the 8 dot products run side by side and their lane reductions are done as
/// one transposed tree, which pairs the same lanes in the same order as each dot alone.
pub fn dot8(k: Kernels, a: &[f32], rows: [&[f32]; 8]) -> [f32; 8] {
    assert!(rows.iter().all(|r| r.len() == a.len()), "dot8: length mismatch");
    match k.path() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels` is only made for paths the CPU supports.
        KernelPath::Avx512 | KernelPath::Avx512Vnni => unsafe { dot8_avx512(a, rows) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        KernelPath::Avx2 | KernelPath::AvxVnni => unsafe { dot8_avx2(a, rows) },
        _ => rows.map(|r| dot(k, a, r)),
    }
}

/// AVX2 twin of [`dot8`]: four keys at a time (two 8-lane halves each, as [`dot_avx2`] keeps
/// them, so the registers hold them), then one reduction tree for all eight.
///
/// # Safety
/// The CPU must support AVX2; every row at least as long as `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot8_avx2(a: &[f32], rows: [&[f32]; 8]) -> [f32; 8] {
    let n = a.len() / 16 * 16;
    let pa = a.as_ptr();
    let pr = rows.map(<[f32]>::as_ptr);
    let mut folded = [_mm256_setzero_ps(); 8];
    for half in 0..2 {
        let mut lo = [_mm256_setzero_ps(); 4];
        let mut hi = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= n <= every length.
            unsafe {
                let (xl, xh) = (_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pa.add(i + 8)));
                for j in 0..4 {
                    let p = pr[half * 4 + j];
                    lo[j] = _mm256_add_ps(lo[j], _mm256_mul_ps(xl, _mm256_loadu_ps(p.add(i))));
                    hi[j] = _mm256_add_ps(hi[j], _mm256_mul_ps(xh, _mm256_loadu_ps(p.add(i + 8))));
                }
            }
            i += 16;
        }
        // Lane l + lane l+8, as dot_avx2 folds before reduce8.
        for j in 0..4 {
            folded[half * 4 + j] = _mm256_add_ps(lo[j], hi[j]);
        }
    }
    let mut out = reduce8x8(folded);
    add_tails(&mut out, a, rows, n);
    out
}

/// AVX-512 twin of [`dot8`].
///
/// # Safety
/// The CPU must support AVX-512F and AVX2; every row at least as long as `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn dot8_avx512(a: &[f32], rows: [&[f32]; 8]) -> [f32; 8] {
    let n = a.len() / 16 * 16;
    let pa = a.as_ptr();
    let pr = rows.map(<[f32]>::as_ptr);
    let mut acc = [_mm512_setzero_ps(); 8];
    let mut i = 0;
    while i < n {
        // SAFETY: i + 16 <= n <= every length.
        unsafe {
            let x = _mm512_loadu_ps(pa.add(i));
            for (acc, p) in acc.iter_mut().zip(pr) {
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(x, _mm512_loadu_ps(p.add(i))));
            }
        }
        i += 16;
    }
    let mut out = reduce8_avx512(acc);
    add_tails(&mut out, a, rows, n);
    out
}

/// The lane sums of 8 dot products' 16-lane accumulators, each in [`reference::dot`]'s
/// pairwise order, as one transposed tree.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn reduce8_avx512(acc: [__m512; 8]) -> [f32; 8] {
    // Lane l + lane l+8, as dot_avx512 folds before reduce8.
    let v = acc.map(|z| {
        let lo = _mm512_castps512_ps256(z);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(z)));
        _mm256_add_ps(lo, hi)
    });
    reduce8x8(v)
}

/// [`reduce8`] of 8 registers at once (each the lane l + lane l+8 fold of a dot product's 16
/// partial sums), in the same order, as one transposed tree.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn reduce8x8(v: [__m256; 8]) -> [f32; 8] {
    // reduce8 for all 8 at once. l + l+4, two rows per register: [row j | row j+1].
    let s4 = |j: usize| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(v[j], v[j + 1]),
            _mm256_permute2f128_ps::<0x31>(v[j], v[j + 1]),
        )
    };
    let (a01, a23, a45, a67) = (s4(0), s4(2), s4(4), s4(6));
    // l + l+2: [0₀ 0₁ 2₀ 2₁ | 1₀ 1₁ 3₀ 3₁] and likewise for rows 4..8.
    let s2 = |x: __m256, y: __m256| _mm256_add_ps(_mm256_shuffle_ps::<0x44>(x, y), _mm256_shuffle_ps::<0xEE>(x, y));
    let (b0, b1) = (s2(a01, a23), s2(a45, a67));
    // Lane 0 + lane 1: rows [0 2 4 6 | 1 3 5 7], then into order.
    let c = _mm256_add_ps(_mm256_shuffle_ps::<0x88>(b0, b1), _mm256_shuffle_ps::<0xDD>(b0, b1));
    let c = _mm256_permutevar8x32_ps(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let mut out = [0f32; 8];
    // SAFETY: `out` holds 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), c) };
    out
}

/// Most query rows [`dot8_rows`] runs side by side on AVX-512: 3 × 8 accumulators, the rows'
/// chunks and a key's fill 28 of the 32 registers.
pub const DOT8_ROWS: usize = 3;

/// [`dot8`] of each of `R` query rows with the same 8 keys, bit for bit: on AVX-512 (for
/// `R <= DOT8_ROWS`) every key chunk is loaded once for all the rows, which attention over a
/// prompt chunk's rows spends most of its loads on otherwise.
pub fn dot8_rows<const R: usize>(k: Kernels, a: [&[f32]; R], rows: [&[f32]; 8]) -> [[f32; 8]; R] {
    let len = a.first().map_or(0, |q| q.len());
    assert!(
        a.iter().all(|q| q.len() == len) && rows.iter().all(|r| r.len() == len),
        "dot8_rows: length mismatch"
    );
    match k.path() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels` is only made for paths the CPU supports.
        KernelPath::Avx512 | KernelPath::Avx512Vnni if R <= DOT8_ROWS => unsafe { dot8_rows_avx512(a, rows) },
        _ => a.map(|q| dot8(k, q, rows)),
    }
}

/// AVX-512 twin of [`dot8_rows`]: per product the arithmetic of [`dot8_avx512`].
///
/// # Safety
/// The CPU must support AVX-512F and AVX2; every row as long as the queries.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn dot8_rows_avx512<const R: usize>(a: [&[f32]; R], rows: [&[f32]; 8]) -> [[f32; 8]; R] {
    let len = a.first().map_or(0, |q| q.len());
    let n = len / 16 * 16;
    let pa = a.map(<[f32]>::as_ptr);
    let pr = rows.map(<[f32]>::as_ptr);
    let mut acc = [[_mm512_setzero_ps(); 8]; R];
    let mut i = 0;
    while i < n {
        // SAFETY: i + 16 <= n <= every length.
        unsafe {
            let x: [__m512; R] = std::array::from_fn(|r| _mm512_loadu_ps(pa[r].add(i)));
            for (j, p) in pr.iter().enumerate() {
                let key = _mm512_loadu_ps(p.add(i));
                for r in 0..R {
                    acc[r][j] = _mm512_add_ps(acc[r][j], _mm512_mul_ps(x[r], key));
                }
            }
        }
        i += 16;
    }
    // Plain loops, not a closure: a closure borrowing `acc` kept it in memory, and the loop
    // above stored every accumulator after each add. The reductions alone in their loop, which
    // LLVM unrolls, so `acc` is never indexed at run time and needs no stack copy either.
    let mut out = [[0f32; 8]; R];
    for r in 0..R {
        out[r] = reduce8_avx512(acc[r]);
    }
    for r in 0..R {
        add_tails(&mut out[r], a[r], rows, n);
    }
    out
}

/// Each of 8 lane-reduced products plus its sequential tail past `n` (the last full 16-lane
/// chunk of `a`). A head size of whole chunks (64, 128) has no tail: the loops are skipped.
#[inline(always)]
fn add_tails(out: &mut [f32; 8], a: &[f32], rows: [&[f32]; 8], n: usize) {
    if n < a.len() {
        for (o, r) in out.iter_mut().zip(rows) {
            *o += tail(&a[n..], &r[n..a.len()]);
        }
    }
}

/// The sequential tail past the last full 16-lane chunk, as the reference sums it.
#[inline(always)]
fn tail(a: &[f32], b: &[f32]) -> f32 {
    let mut t = 0f32;
    for (x, y) in a.iter().zip(b) {
        t += x * y;
    }
    t
}

/// Pairwise reduction of 8 lanes (already folded from 16 as lane l + lane l+8).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) fn reduce8(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s4 = _mm_add_ps(lo, hi); // lanes l + l+4
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4)); // lanes l + l+2
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2)); // lane 0 + lane 1
    _mm_cvtss_f32(s1)
}

/// AVX2 twin: the 16 lanes as two 8-lane registers.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len()) / 16 * 16;
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i < n {
        // SAFETY: i + 16 <= n <= both lengths.
        unsafe {
            lo = _mm256_add_ps(
                lo,
                _mm256_mul_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i))),
            );
            hi = _mm256_add_ps(
                hi,
                _mm256_mul_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8))),
            );
        }
        i += 16;
    }
    reduce8(_mm256_add_ps(lo, hi)) + tail(&a[n..], &b[n..])
}

/// AVX-512 twin: the 16 lanes in one register.
///
/// # Safety
/// The CPU must support AVX-512F and AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
pub unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len()) / 16 * 16;
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        // SAFETY: i + 16 <= n <= both lengths.
        unsafe {
            acc = _mm512_add_ps(
                acc,
                _mm512_mul_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i))),
            );
        }
        i += 16;
    }
    let lo = _mm512_castps512_ps256(acc);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
    reduce8(_mm256_add_ps(lo, hi)) + tail(&a[n..], &b[n..])
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::cpu::dispatch::KernelPath;
    use crate::kernels::cpu::paths_run::PathsRun;

    pub(crate) use crate::kernels::cpu::testdata::noise;

    #[test]
    fn every_path_is_bit_identical_to_the_reference() {
        let mut paths = PathsRun::new("kernels::cpu::f32::tests::every_path_is_bit_identical_to_the_reference");
        for k in Kernels::all_supported() {
            paths.record(k.path());
            for n in [0, 1, 7, 15, 16, 17, 31, 64, 100, 576, 1536, 1000] {
                for (seed, scale) in [(1, 1.0), (2, 1e4), (3, 1e-6)] {
                    let a = noise(n, seed, scale);
                    let b = noise(n, seed + 10, 1.0);
                    let want = reference::dot(&a, &b);
                    let got = dot(k, &a, &b);
                    assert_eq!(got.to_bits(), want.to_bits(), "{} n={n} scale={scale}", k.path());
                }
            }
            assert_eq!(dot(k, &[0.0; 33], &[5.0; 33]), 0.0);
        }
        paths.check(&KernelPath::ALL);
    }

    #[test]
    fn dot8_is_eight_dots_bit_for_bit() {
        let mut paths = PathsRun::new("kernels::cpu::f32::tests::dot8_is_eight_dots_bit_for_bit");
        for k in Kernels::all_supported() {
            paths.record(k.path());
            for n in [0, 1, 15, 16, 17, 48, 64, 100, 128] {
                for (seed, scale) in [(1, 1.0), (2, 1e4), (3, 1e-6)] {
                    let a = noise(n, seed, scale);
                    let rows: Vec<Vec<f32>> = (0..8).map(|j| noise(n, seed + 10 + j, 1.0)).collect();
                    let got = dot8(k, &a, std::array::from_fn(|j| rows[j].as_slice()));
                    for (j, r) in rows.iter().enumerate() {
                        let want = reference::dot(&a, r);
                        assert_eq!(got[j].to_bits(), want.to_bits(), "{} n={n} row {j}", k.path());
                    }
                }
            }
            // Several query rows against the same keys: each product as dot8 gives it.
            for n in [0, 1, 16, 17, 64, 100, 128] {
                let q: Vec<Vec<f32>> = (0..4).map(|r| noise(n, 40 + r, 1.0)).collect();
                let rows: Vec<Vec<f32>> = (0..8).map(|j| noise(n, 60 + j, 1.0)).collect();
                let rows: [&[f32]; 8] = std::array::from_fn(|j| rows[j].as_slice());
                let want: Vec<[f32; 8]> = q.iter().map(|q| dot8(k, q, rows)).collect();
                let bits = |v: &[[f32; 8]]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
                let three = dot8_rows::<3>(k, std::array::from_fn(|r| q[r].as_slice()), rows);
                assert_eq!(bits(&three), bits(&want[..3]), "{} n={n}, 3 rows", k.path());
                let two = dot8_rows::<2>(k, std::array::from_fn(|r| q[r].as_slice()), rows);
                assert_eq!(bits(&two), bits(&want[..2]), "{} n={n}, 2 rows", k.path());
                let four = dot8_rows::<4>(k, std::array::from_fn(|r| q[r].as_slice()), rows);
                assert_eq!(bits(&four), bits(&want), "{} n={n}, 4 rows", k.path());
            }
            // Signed zeros come out as a lone dot gives them.
            let z = [-0.0f32; 16];
            let got = dot8(k, &[1.0; 16], [&z; 8]);
            assert!(
                got.iter()
                    .all(|v| v.to_bits() == reference::dot(&[1.0; 16], &z).to_bits())
            );
        }
        paths.check(&KernelPath::ALL);
    }
}
