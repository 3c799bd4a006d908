//! Matrix-product micro-benchmark: GB/s of weight bytes and GFLOP/s per format, kernel path,
//! thread count and number of activation rows (1: batch-1 decode's matrix-vector product; more:
//! prefill and batched decode) at SmolLM2-135M's shapes. Small matrices fit in L2, so their
//! matrix-vector figures are cache bandwidth; the 49152×576 head is the one that streams from
//! memory.

use std::time::{Duration, Instant};

use anyhow::Result;
use baton_worker::kernels::cpu::dispatch::Kernels;
use baton_worker::kernels::cpu::matmul::{Matrix, WeightFormat, matmul};
use baton_worker::kernels::cpu::q8::QuantizedRows;
use baton_worker::threads::ThreadPool;

/// (rows, cols): q/o, gate/up, down, head.
const SHAPES: [(usize, usize); 4] = [(576, 576), (1536, 576), (576, 1536), (49152, 576)];

fn noise(n: usize, seed: u64) -> Vec<f32> {
    baton_worker::kernels::cpu::testdata::noise(n, seed, 0.5)
}

/// Run `matmul` for about `ms` milliseconds; returns seconds per call.
fn time_calls(
    k: Kernels,
    pool: &ThreadPool,
    x: &[f32],
    w: &Matrix,
    out: &mut [f32],
    xq: &mut QuantizedRows,
    ms: u64,
) -> f64 {
    let budget = Duration::from_millis(ms);
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < budget {
        for _ in 0..4 {
            matmul(k, pool, x, w.view(), None, out, xq);
        }
        calls += 4;
    }
    start.elapsed().as_secs_f64() / calls as f64
}

/// Print one JSON line per (shape, format, path, threads, tokens).
pub fn run(threads: &[usize], tokens: &[usize], formats: &[WeightFormat], ms: u64, reps: usize) -> Result<()> {
    let pools: Vec<ThreadPool> = threads.iter().map(|&t| ThreadPool::new(t)).collect();
    let mut xq = QuantizedRows::default();
    // Cost of one job with 36 empty tasks (576 rows in 16-row chunks): the per-matmul overhead.
    for pool in &pools {
        let mut secs: Vec<f64> = (0..reps.max(1))
            .map(|_| {
                let start = Instant::now();
                let mut calls = 0u64;
                while start.elapsed() < Duration::from_millis(ms) {
                    for _ in 0..16 {
                        pool.run(36, &|i| {
                            std::hint::black_box(i);
                        });
                    }
                    calls += 16;
                }
                start.elapsed().as_secs_f64() / calls as f64
            })
            .collect();
        secs.sort_by(f64::total_cmp);
        let line = serde_json::json!({"pool_job_us": secs[secs.len() / 2] * 1e6, "threads": pool.threads()});
        println!("{line}");
    }
    for (rows, cols) in SHAPES {
        let wf = noise(rows * cols, rows as u64 ^ cols as u64);
        for &format in formats {
            let w = Matrix::from_f32(wf.clone(), cols, format);
            for k in Kernels::all_supported() {
                for (pool, &t) in pools.iter().flat_map(|p| tokens.iter().map(move |t| (p, t))) {
                    let x = noise(t * cols, 7);
                    let mut out = vec![0f32; t * rows];
                    // Warm up (page in, fill caches), then interleave nothing: one config at a time.
                    time_calls(k, pool, &x, &w, &mut out, &mut xq, ms / 4);
                    let mut secs: Vec<f64> = (0..reps.max(1))
                        .map(|_| time_calls(k, pool, &x, &w, &mut out, &mut xq, ms))
                        .collect();
                    secs.sort_by(f64::total_cmp);
                    let s = secs[secs.len() / 2];
                    let line = serde_json::json!({
                        "shape": format!("{rows}x{cols}"),
                        "weights": format.name(),
                        "kernel_path": k.path().name(),
                        "threads": pool.threads(),
                        "tokens": t,
                        "bytes": w.bytes(),
                        "us_per_call": s * 1e6,
                        "gb_per_s": w.bytes() as f64 / s / 1e9,
                        "gflop_per_s": 2.0 * (t * rows * cols) as f64 / s / 1e9,
                    });
                    println!("{line}");
                }
            }
        }
    }
    Ok(())
}
