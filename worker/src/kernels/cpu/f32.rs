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
        KernelPath::Avx2 => unsafe { dot_avx2(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        KernelPath::Avx512 | KernelPath::Avx512Vnni => unsafe { dot_avx512(a, b) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => reference::dot(a, b),
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

    pub(crate) use crate::kernels::cpu::testdata::noise;

    #[test]
    fn every_path_is_bit_identical_to_the_reference() {
        for k in Kernels::all_supported() {
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
    }
}
