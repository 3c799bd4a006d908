//! The machine's streaming-read bandwidth over a given byte count: the roofline for
//! memory-bound batch-1 decode, which must read every weight byte once per token.

use std::time::Instant;

use crate::threads::{SharedMut, ThreadPool};

/// Bytes each pool task reads (large enough that claiming a task costs nothing next to it).
const CHUNK: usize = 1 << 20;

/// Sum `words` with independent lanes, so the compiler can vectorise and the loop is bound by
/// loads, not by one serial dependency chain.
fn sum_words(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let mut it = words.chunks_exact(8);
    for c in &mut it {
        for (l, &w) in lanes.iter_mut().zip(c) {
            *l = l.wrapping_add(w);
        }
    }
    let tail = it.remainder().iter().fold(0u64, |a, &w| a.wrapping_add(w));
    lanes.iter().fold(tail, |a, &l| a.wrapping_add(l))
}

/// Best-of-`reps` GB/s reading a `bytes`-sized buffer once per pass across `pool`'s threads.
pub fn stream_read_gb_per_s(bytes: usize, pool: &ThreadPool, reps: usize) -> f64 {
    let words = (bytes / 8).max(CHUNK / 8);
    // Non-zero contents, written once, so the pages are real memory rather than the zero page.
    let buf: Vec<u64> = (0..words as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let per_task = CHUNK / 8;
    let tasks = words.div_ceil(per_task);
    let mut sums = vec![0u64; tasks];
    let mut best = 0f64;
    for _ in 0..reps.max(1) {
        let out = SharedMut::new(&mut sums);
        let t = Instant::now();
        pool.run(tasks, &|task| {
            let part = &buf[task * per_task..((task + 1) * per_task).min(words)];
            // SAFETY: each task writes only its own slot.
            unsafe { out.slice(task, 1)[0] = sum_words(part) };
        });
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(&sums);
        best = best.max((words * 8) as f64 / secs / 1e9);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_sum_equals_a_plain_sum() {
        let v: Vec<u64> = (0..1003).map(|i| i * 7 + 3).collect();
        assert_eq!(sum_words(&v), v.iter().sum::<u64>());
        assert_eq!(sum_words(&[]), 0);
    }

    #[test]
    fn bandwidth_is_positive_and_finite() {
        let gbs = stream_read_gb_per_s(4 << 20, &ThreadPool::new(2), 2);
        assert!(gbs.is_finite() && gbs > 0.0, "{gbs}");
    }
}
