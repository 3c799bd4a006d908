//! CPU kernels. `reference` is the fp32 correctness oracle every faster kernel is tested against;
//! `f32` is its SIMD twin (picked at run time by `dispatch`), `q8` the Q8_0 panel layout and
//! activation quantization, `q8_gemm` the Q8_0 panel kernels, `q4` the Q4_0/Q4_1 kernels, `half`
//! the bf16/f16 ones, `elementwise` the row-wise ones (norms, RoPE, SiLU, softmax) on the
//! dispatched path, `linear_attention` the Gated DeltaNet ones (causal conv1d, delta rule),
//! `moe` routes rows to experts, and `matmul` runs them over weight matrices on a thread pool.

pub mod aligned;
pub mod attention;
pub mod dispatch;
pub mod elementwise;
pub mod f32;
pub mod half;
pub mod linear_attention;
pub mod matmul;
pub mod moe;
#[cfg(test)]
pub(crate) mod paths_run;
pub mod q4;
pub mod q8;
pub mod q8_gemm;
pub mod reference;
pub mod testdata;

/// Q4 tiles of `R` weight rows read their rows side by side, which the hardware streamers miss
/// in decode (one token): every tile prefetches the quants, scales and offsets of the tile this
/// many tiles ahead. Scales are streams of their own; without their prefetch each tile
/// waited on memory at their first use (decode took 1.7-2.4x as long).
pub(crate) const PREFETCH_TILES: usize = 2;

/// Hint the cache lines of the `n` elements from `p` with `_mm_prefetch` hint `HINT`. `p` may
/// point past its matrix (a hint never faults).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_lines<const HINT: i32, T>(p: *const T, n: usize) {
    let bytes = n * size_of::<T>();
    for off in (0..bytes).step_by(64) {
        // SAFETY: prefetching is a hint; it never faults, whatever the address.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(p.cast::<i8>().wrapping_add(off)) };
    }
}

/// Hint the `n` elements from `p` into L1. `p` may point past its matrix.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T, n: usize) {
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T0 }, T>(p, n);
}

/// Hint the `n` elements from `p` into L2 only (far-ahead prefetch that should not evict what
/// L1 is working on). `p` may point past its matrix.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_l2<T>(p: *const T, n: usize) {
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T1 }, T>(p, n);
}
