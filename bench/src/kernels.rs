//! Matrix-product micro-benchmark: GB/s of weight bytes and GFLOP/s per format, kernel path,
//! thread count and number of activation rows (1: batch-1 decode's matrix-vector product; more:
//! prefill and batched decode) at SmolLM2-135M's shapes. Small matrices fit in L2, so their
//! matrix-vector figures are cache bandwidth; the 49152×576 head is the one that streams from
//! memory. `--layers N` times instead a pass over N decoder layers' products in forward
//! order: the bytes a stage streams per batched-decode step, which do not stay in any cache.

use std::time::{Duration, Instant};

use anyhow::Result;
use baton_worker::kernels::cpu::dispatch::Kernels;
use baton_worker::kernels::cpu::matmul::{Matrix, WeightFormat, matmul};
use baton_worker::kernels::cpu::q8::QuantizedRows;
use baton_worker::threads::ThreadPool;

/// (rows, cols): q/o, gate/up, down, head.
const SHAPES: [(usize, usize); 4] = [(576, 576), (1536, 576), (576, 1536), (49152, 576)];

/// One SmolLM2-135M decoder layer's products in forward order, (rows, cols): q, k, v, o, gate,
/// up, down.
const LAYER: [(usize, usize); 7] = [
    (576, 576),
    (192, 576),
    (192, 576),
    (576, 576),
    (1536, 576),
    (1536, 576),
    (576, 1536),
];

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

/// One measurement's JSON line: `bytes` of weights read and `flops` done per call of `secs`.
#[allow(clippy::too_many_arguments)]
fn report(
    shape: String,
    format: WeightFormat,
    k: Kernels,
    threads: usize,
    t: usize,
    bytes: usize,
    flops: f64,
    secs: f64,
) {
    let line = serde_json::json!({
        "shape": shape,
        "weights": format.name(),
        "kernel_path": k.path().name(),
        "threads": threads,
        "tokens": t,
        "bytes": bytes,
        "us_per_call": secs * 1e6,
        "us_per_token": secs * 1e6 / t as f64,
        "gb_per_s": bytes as f64 / secs / 1e9,
        "gflop_per_s": flops / secs / 1e9,
    });
    println!("{line}");
}

/// Seconds per pass over every product of `layers` for `t` tokens (one input and one output
/// buffer, sized for the widest product, serve them all), timed for about `ms` milliseconds.
fn time_pass(k: Kernels, pool: &ThreadPool, layers: &[Vec<Matrix>], t: usize, ms: u64, xq: &mut QuantizedRows) -> f64 {
    let widest = LAYER.iter().map(|&(r, c)| r.max(c)).max().unwrap_or(0);
    let x = noise(t * widest, 7);
    let mut out = vec![0f32; t * widest];
    let budget = Duration::from_millis(ms);
    let start = Instant::now();
    let mut passes = 0u64;
    while passes == 0 || start.elapsed() < budget {
        for layer in layers {
            for w in layer {
                let (rows, cols) = (w.view().rows(), w.view().cols());
                matmul(k, pool, &x[..t * cols], w.view(), None, &mut out[..t * rows], xq);
            }
        }
        passes += 1;
    }
    start.elapsed().as_secs_f64() / passes as f64
}

/// The `--layers` pass: one JSON line per (format, path, threads, tokens).
fn run_layers(pools: &[ThreadPool], tokens: &[usize], formats: &[WeightFormat], ms: u64, reps: usize, n: usize) {
    let flops_per_token: usize = LAYER.iter().map(|&(r, c)| 2 * r * c).sum::<usize>() * n;
    for &format in formats {
        // Every layer gets its own copy, so the pass streams n layers' bytes as a stage does.
        let layers: Vec<Vec<Matrix>> = (0..n)
            .map(|l| {
                LAYER
                    .iter()
                    .enumerate()
                    .map(|(i, &(rows, cols))| Matrix::from_f32(noise(rows * cols, (l * 7 + i) as u64), cols, format))
                    .collect()
            })
            .collect();
        let bytes: usize = layers.iter().flatten().map(Matrix::bytes).sum();
        let mut xq = QuantizedRows::default();
        for k in Kernels::all_supported() {
            for (pool, &t) in pools.iter().flat_map(|p| tokens.iter().map(move |t| (p, t))) {
                time_pass(k, pool, &layers, t, ms / 4, &mut xq);
                let mut secs: Vec<f64> = (0..reps.max(1))
                    .map(|_| time_pass(k, pool, &layers, t, ms, &mut xq))
                    .collect();
                secs.sort_by(f64::total_cmp);
                let s = secs[secs.len() / 2];
                let flops = (flops_per_token * t) as f64;
                report(format!("{n} layers"), format, k, pool.threads(), t, bytes, flops, s);
            }
        }
    }
}

/// Print one JSON line per (shape, format, path, threads, tokens), or with `layers` the pass.
pub fn run(
    threads: &[usize],
    tokens: &[usize],
    formats: &[WeightFormat],
    ms: u64,
    reps: usize,
    layers: usize,
) -> Result<()> {
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
    if layers > 0 {
        run_layers(&pools, tokens, formats, ms, reps, layers);
        return Ok(());
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
                    let flops = 2.0 * (t * rows * cols) as f64;
                    report(
                        format!("{rows}x{cols}"),
                        format,
                        k,
                        pool.threads(),
                        t,
                        w.bytes(),
                        flops,
                        s,
                    );
                }
            }
        }
    }
    Ok(())
}
