//! bf16 and f16 weights × f32 activations.
//!
//! Weights stay 16-bit in memory (half the bytes of f32, so memory-bound decode reads half as
//! much) and are widened to f32 in registers; the products use [`super::reference::dot`]'s
//! arithmetic:
//! 16 lanes of partial sums, a multiply then an add per element, the same pairwise reduction
//! and sequential tail. Widening is exact, so every path gives the bits of the reference dot on
//! the widened weights: a 16-bit stage equals an f32 stage holding the rounded weights. The same
//! kernels read an f16 KV cache.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::dispatch::{KernelPath, Kernels};

/// Which 16-bit float the weights are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HalfKind {
    /// bfloat16: f32's exponent, 8 bits of mantissa.
    Bf16,
    /// IEEE half: 5-bit exponent, 11 bits of mantissa.
    F16,
}

impl HalfKind {
    /// Widen one value.
    #[inline]
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            Self::Bf16 => f32::from_bits((bits as u32) << 16),
            Self::F16 => half::f16::from_bits(bits).to_f32(),
        }
    }

    /// Whether every value of `w` is within this format's range: bf16 has f32's, f16 ends at
    /// ±65504 (a matrix past it stays f32 rather than turn into infinities).
    pub fn holds(self, w: &[f32]) -> bool {
        self == Self::Bf16 || w.iter().all(|v| v.abs() <= 65504.0)
    }

    /// Round one f32 to this format (nearest, ties to even).
    pub fn from_f32(self, v: f32) -> u16 {
        match self {
            Self::Bf16 => half::bf16::from_f32(v).to_bits(),
            Self::F16 => half::f16::from_f32(v).to_bits(),
        }
    }
}

/// A row-major `[rows × cols]` matrix of 16-bit floats.
#[derive(Debug, Clone, PartialEq)]
pub struct HalfMatrix {
    pub rows: usize,
    pub cols: usize,
    pub kind: HalfKind,
    pub data: Vec<u16>,
}

impl HalfMatrix {
    /// Round a row-major f32 matrix.
    pub fn from_f32(w: &[f32], cols: usize, kind: HalfKind) -> Self {
        assert!(cols > 0 && w.len().is_multiple_of(cols), "HalfMatrix::from_f32: shape");
        Self {
            rows: w.len() / cols,
            cols,
            kind,
            data: w.iter().map(|&v| kind.from_f32(v)).collect(),
        }
    }

    /// Row `r`'s bits.
    #[inline]
    pub fn row(&self, r: usize) -> &[u16] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Row `r` widened to f32.
    pub fn widen_row(&self, r: usize, out: &mut [f32]) {
        out.iter_mut()
            .zip(self.row(r))
            .for_each(|(o, &b)| *o = self.kind.to_f32(b));
    }
}

/// `x · w` on path `k`; bit-identical to [`super::reference::dot`] of `x` and the widened `w`.
#[inline]
pub fn dot(k: Kernels, kind: HalfKind, x: &[f32], w: &[u16]) -> f32 {
    assert_eq!(x.len(), w.len(), "half::dot: length mismatch");
    match k.path() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels` is only made for paths the CPU supports.
        KernelPath::Avx512 | KernelPath::Avx512Vnni => unsafe { dot_avx512(kind, x, w) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above (the AVX2 path includes F16C).
        KernelPath::Avx2 | KernelPath::AvxVnni => unsafe { dot_avx2(kind, x, w) },
        _ => dot_scalar(kind, x, w),
    }
}

/// `dst[i] = src[i]` widened to f32 on path `k` (exact: every path gives the same bits).
#[inline]
pub fn widen(k: Kernels, kind: HalfKind, src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "half::widen: length mismatch");
    match k.path() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernels` is only made for paths the CPU supports; AVX2 includes F16C.
        KernelPath::Avx2 | KernelPath::AvxVnni | KernelPath::Avx512 | KernelPath::Avx512Vnni => unsafe {
            widen_avx2(kind, src, dst)
        },
        _ => widen_scalar(kind, src, dst),
    }
}

/// Scalar twin of [`widen`].
pub fn widen_scalar(kind: HalfKind, src: &[u16], dst: &mut [f32]) {
    dst.iter_mut().zip(src).for_each(|(d, &b)| *d = kind.to_f32(b));
}

/// Eight 16-bit floats at `p` widened to f32.
///
/// # Safety
/// `p` must point to 8 readable values; the CPU must support AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn widen8(kind: HalfKind, p: *const u16) -> __m256 {
    // SAFETY: the caller guarantees 8 values at p.
    let bits = unsafe { _mm_loadu_si128(p.cast()) };
    match kind {
        HalfKind::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits))),
        HalfKind::F16 => _mm256_cvtph_ps(bits),
    }
}

/// AVX2 twin of [`widen`]: eight values per step.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn widen_avx2(kind: HalfKind, src: &[u16], dst: &mut [f32]) {
    let n = src.len().min(dst.len()) / 8 * 8;
    let mut i = 0;
    while i < n {
        // SAFETY: i + 8 <= n <= both lengths.
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(i), widen8(kind, src.as_ptr().add(i))) };
        i += 8;
    }
    widen_scalar(kind, &src[n..], &mut dst[n..]);
}

/// AVX2 twin of [`dot`]: the reference's 16 lanes as two 8-lane registers, folded as the
/// reference folds them.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_avx2(kind: HalfKind, x: &[f32], w: &[u16]) -> f32 {
    let n = x.len().min(w.len()) / 16 * 16;
    let (px, pw) = (x.as_ptr(), w.as_ptr());
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i < n {
        // SAFETY: i + 16 <= n <= both lengths.
        unsafe {
            lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(px.add(i)), widen8(kind, pw.add(i))));
            hi = _mm256_add_ps(
                hi,
                _mm256_mul_ps(_mm256_loadu_ps(px.add(i + 8)), widen8(kind, pw.add(i + 8))),
            );
        }
        i += 16;
    }
    let mut tail = 0f32;
    for (&a, &b) in x[n..].iter().zip(&w[n..]) {
        tail += a * kind.to_f32(b);
    }
    super::f32::reduce8(_mm256_add_ps(lo, hi)) + tail
}

/// Scalar twin: the reference dot's lanes over widened values.
pub fn dot_scalar(kind: HalfKind, x: &[f32], w: &[u16]) -> f32 {
    use super::reference::LANES;
    let n = x.len() / LANES * LANES;
    let mut acc = [0f32; LANES];
    for (xc, wc) in x[..n].chunks_exact(LANES).zip(w[..n].chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] += xc[l] * kind.to_f32(wc[l]);
        }
    }
    let mut tail = 0f32;
    for (&a, &b) in x[n..].iter().zip(&w[n..]) {
        tail += a * kind.to_f32(b);
    }
    super::reference::reduce_lanes(acc) + tail
}

/// AVX-512 twin: 16 weights widened per step (`vpmovzxwd` + shift for bf16, `vcvtph2ps` for f16).
///
/// # Safety
/// The CPU must support AVX-512F and AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn dot_avx512(kind: HalfKind, x: &[f32], w: &[u16]) -> f32 {
    let n = x.len().min(w.len()) / 16 * 16;
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        // SAFETY: i + 16 <= n <= both lengths.
        unsafe {
            let bits = _mm256_loadu_si256(w.as_ptr().add(i).cast());
            let wf = match kind {
                HalfKind::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits))),
                HalfKind::F16 => _mm512_cvtph_ps(bits),
            };
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(x.as_ptr().add(i)), wf));
        }
        i += 16;
    }
    let mut lanes = [0f32; 16];
    // SAFETY: 16 floats.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
    let mut tail = 0f32;
    for (&a, &b) in x[n..].iter().zip(&w[n..]) {
        tail += a * kind.to_f32(b);
    }
    super::reference::reduce_lanes(lanes) + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::dispatch::KernelPath;
    use crate::kernels::cpu::paths_run::PathsRun;
    use crate::kernels::cpu::reference;
    use crate::kernels::cpu::testdata::noise;

    #[test]
    fn every_path_gives_the_reference_dot_of_the_widened_weights() {
        let mut paths =
            PathsRun::new("kernels::cpu::half::tests::every_path_gives_the_reference_dot_of_the_widened_weights");
        for kind in [HalfKind::Bf16, HalfKind::F16] {
            for n in [0, 1, 15, 16, 17, 64, 576, 1000] {
                for (seed, scale) in [(1u64, 1.0f32), (2, 1e3), (3, 1e-3)] {
                    let x = noise(n, seed, scale);
                    let m = HalfMatrix::from_f32(&noise(n.max(1), seed + 5, 1.0)[..n.max(1)], n.max(1), kind);
                    let w = &m.data[..n];
                    let wide: Vec<f32> = w.iter().map(|&b| kind.to_f32(b)).collect();
                    let want = reference::dot(&x, &wide);
                    for k in Kernels::all_supported() {
                        paths.record(k.path());
                        assert_eq!(
                            dot(k, kind, &x, w).to_bits(),
                            want.to_bits(),
                            "{kind:?} {} n={n}",
                            k.path()
                        );
                    }
                }
            }
        }
        // Rounding: bf16 keeps 8 bits of mantissa, f16 11 (and overflows past 65504).
        assert_eq!(HalfKind::Bf16.to_f32(HalfKind::Bf16.from_f32(1.0 + 1.0 / 256.0)), 1.0);
        assert_eq!(
            HalfKind::F16.to_f32(HalfKind::F16.from_f32(1.0 + 1.0 / 1024.0)),
            1.0 + 1.0 / 1024.0
        );
        assert!(HalfKind::F16.to_f32(HalfKind::F16.from_f32(1e6)).is_infinite());
        paths.check(&KernelPath::ALL);
    }

    #[test]
    fn widening_is_exact_on_every_path() {
        let mut paths = PathsRun::new("kernels::cpu::half::tests::widening_is_exact_on_every_path");
        for kind in [HalfKind::Bf16, HalfKind::F16] {
            for n in [0, 1, 7, 8, 9, 64, 100] {
                // Every bit pattern class: zeros, subnormals, infinities, NaNs, ordinary values.
                let src: Vec<u16> = (0..n as u32)
                    .map(|i| (i.wrapping_mul(40503) ^ (i << 11)) as u16)
                    .collect();
                let mut want = vec![0f32; n];
                widen_scalar(kind, &src, &mut want);
                for k in Kernels::all_supported() {
                    paths.record(k.path());
                    let mut got = vec![1f32; n];
                    widen(k, kind, &src, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{kind:?} {} n={n}", k.path());
                }
            }
        }
        paths.check(&KernelPath::ALL);
    }
}
