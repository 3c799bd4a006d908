//! The machine's streaming-read bandwidth over a given byte count: the roofline for
//! memory-bound batch-1 decode, which must read every weight byte once per token.
//!
//! The probe is written to be as fast and as stable as the best simple read loop, so that
//! "decode ÷ roofline" means what it says: each thread reads one contiguous share in the same
//! order every pass (no task hand-offs inside a pass, so no pass finds part of the buffer still
//! in the last-level cache because the order changed), with independent accumulators, after an
//! untimed pass, keeping the best of the timed passes of every load width the CPU has (256-bit
//! loads read fastest on one CPU, 512-bit on another). `bench/stream_read.c` is the OpenMP loop
//! it is held against (docs/benchmarks.md).

use std::time::Instant;

use crate::threads::{SharedMut, ThreadPool};

/// Sum `words` with wrapping adds: the reference for [`sum_words`].
pub fn sum_words_reference(words: &[u64]) -> u64 {
    words.iter().fold(0u64, |a, &w| a.wrapping_add(w))
}

/// Sum `words` with eight independent lanes, so the loop is bound by loads rather than by one
/// dependency chain: the portable loop, and what [`sum_words`] runs without AVX-512. Wrapping
/// addition is associative, so it equals the reference.
pub fn sum_words_lanes(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let mut it = words.chunks_exact(8);
    for c in &mut it {
        for (l, &w) in lanes.iter_mut().zip(c) {
            *l = l.wrapping_add(w);
        }
    }
    let tail = sum_words_reference(it.remainder());
    lanes.iter().fold(tail, |a, &l| a.wrapping_add(l))
}

/// Sum `words` with four 512-bit accumulators (whole cache lines per load). On a 2-vCPU Xeon
/// (AVX-512) the portable loop read 12 GB/s a core and this one 14 (27.8 against 24 GB/s with
/// two threads), while Q8_0 decode streamed its weights at 15 and 30: the portable loop was
/// not the read bound there. The plain-code 32-lane version tried earlier on an EPYC (3 GB/s)
/// left its lanes to the compiler; these are explicit.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_words_avx512(words: &[u64]) -> u64 {
    use std::arch::x86_64::{
        __m512i, _mm512_add_epi64, _mm512_loadu_si512, _mm512_reduce_add_epi64, _mm512_setzero_si512,
    };
    let mut acc = [_mm512_setzero_si512(); 4];
    let mut it = words.chunks_exact(32);
    for c in &mut it {
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: `c` holds 32 words, so words 8k..8k + 8 are in bounds; loadu needs no
            // alignment.
            let v = unsafe { _mm512_loadu_si512(c.as_ptr().add(8 * k).cast::<__m512i>()) };
            *a = _mm512_add_epi64(*a, v);
        }
    }
    let all = _mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3]));
    (_mm512_reduce_add_epi64(all) as u64).wrapping_add(sum_words_reference(it.remainder()))
}

/// Sum `words` with four 256-bit accumulators. On a 2-vCPU AMD EPYC (Zen 4, whose 512-bit
/// operations run as two 256-bit halves) one core read 30.5 GB/s this way against 27 with the
/// 512-bit loop; on the Xeon the 512-bit loop was the faster.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(words: &[u64]) -> u64 {
    use std::arch::x86_64::{__m256i, _mm256_add_epi64, _mm256_loadu_si256, _mm256_setzero_si256, _mm256_storeu_si256};
    let mut acc = [_mm256_setzero_si256(); 4];
    let mut it = words.chunks_exact(16);
    for c in &mut it {
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: `c` holds 16 words, so words 4k..4k + 4 are in bounds; loadu needs no
            // alignment.
            let v = unsafe { _mm256_loadu_si256(c.as_ptr().add(4 * k).cast::<__m256i>()) };
            *a = _mm256_add_epi64(*a, v);
        }
    }
    let all = _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3]));
    let mut lanes = [0u64; 4];
    // SAFETY: `lanes` is 32 bytes; storeu needs no alignment.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), all) };
    lanes
        .iter()
        .fold(sum_words_reference(it.remainder()), |a, &l| a.wrapping_add(l))
}

/// A way to read memory: which is fastest depends on the CPU, so the probe times each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadLoop {
    /// Eight independent 64-bit lanes, in portable code.
    Lanes,
    /// Four 256-bit accumulators (AVX2).
    Avx2,
    /// Four 512-bit accumulators (AVX-512F).
    Avx512,
}

impl ReadLoop {
    /// The loops this CPU can run.
    pub fn available() -> Vec<ReadLoop> {
        let mut loops = vec![ReadLoop::Lanes];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                loops.push(ReadLoop::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                loops.push(ReadLoop::Avx512);
            }
        }
        loops
    }

    /// Sum `words` this way (equals [`sum_words_reference`]); a loop this CPU cannot run falls
    /// back to [`ReadLoop::Lanes`].
    pub fn sum(self, words: &[u64]) -> u64 {
        #[cfg(target_arch = "x86_64")]
        match self {
            // SAFETY: the feature was detected.
            ReadLoop::Avx512 if std::arch::is_x86_feature_detected!("avx512f") => {
                return unsafe { sum_words_avx512(words) };
            }
            // SAFETY: the feature was detected.
            ReadLoop::Avx2 if std::arch::is_x86_feature_detected!("avx2") => return unsafe { sum_words_avx2(words) },
            _ => {}
        }
        sum_words_lanes(words)
    }
}

/// Best-of-`reps` GB/s reading a `bytes`-sized buffer once per pass across `pool`'s threads,
/// each thread its own contiguous share, with the fastest of the [`ReadLoop`]s this CPU has.
pub fn stream_read_gb_per_s(bytes: usize, pool: &ThreadPool, reps: usize) -> f64 {
    let words = (bytes / 8).max(1 << 17);
    // Non-zero contents, written once, so the pages are real memory rather than the zero page.
    let buf: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let threads = pool.threads().max(1);
    let share = |t: usize| t * words / threads..(t + 1) * words / threads;
    let mut sums = vec![0u64; threads];
    let mut best = 0f64;
    for read in ReadLoop::available() {
        // One untimed pass: page-table and TLB warm-up, threads awake.
        for rep in 0..=reps.max(1) {
            let out = SharedMut::new(&mut sums);
            let t = Instant::now();
            pool.run(threads, &|task| {
                // SAFETY: each task writes only its own slot.
                unsafe { out.slice(task, 1)[0] = read.sum(&buf[share(task)]) };
            });
            let secs = t.elapsed().as_secs_f64();
            std::hint::black_box(&sums);
            if rep > 0 {
                best = best.max((words * 8) as f64 / secs / 1e9);
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wide_sum_equals_the_reference_at_every_length() {
        let v: Vec<u64> = (0..1003u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
        for n in [0, 1, 7, 15, 16, 17, 31, 32, 33, 64, 500, 1003] {
            for read in ReadLoop::available() {
                assert_eq!(read.sum(&v[..n]), sum_words_reference(&v[..n]), "{read:?}, {n} words");
            }
            assert_eq!(sum_words_lanes(&v[..n]), sum_words_reference(&v[..n]), "{n} words");
        }
    }

    #[test]
    fn the_avx512_sum_equals_the_reference() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            let v: Vec<u64> = (0..1003u64).map(|i| i.wrapping_mul(0xD1B5_4A32_D192_ED03)).collect();
            for n in [0, 1, 31, 32, 33, 63, 64, 65, 1003] {
                // SAFETY: AVX-512F was detected.
                let wide = unsafe { sum_words_avx512(&v[..n]) };
                assert_eq!(wide, sum_words_reference(&v[..n]), "{n} words");
            }
            assert!(ReadLoop::available().contains(&ReadLoop::Avx512));
            return;
        }
        baton_shared::skip_report::skip(
            "roofline::tests::the_avx512_sum_equals_the_reference",
            "this CPU has no AVX-512F; the portable sum is tested above",
        );
    }

    #[test]
    fn bandwidth_is_positive_and_finite() {
        for threads in [1, 2, 3] {
            let gbs = stream_read_gb_per_s(4 << 20, &ThreadPool::new(threads), 2);
            assert!(gbs.is_finite() && gbs > 0.0, "{threads} threads: {gbs}");
        }
    }
}
