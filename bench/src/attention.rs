//! Attention micro-benchmark: the CPU attention of one prompt chunk (`rows` query rows ending at
//! position `context`) over a paged f32 cache at SmolLM2-135M's shape (9 query heads, 3 KV
//! heads, head size 64), per kernel path, thread count and context length. Long contexts are
//! where a chunk's keys and values outgrow the L2 cache, which is what this measures.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use baton_worker::kernels::cpu::attention::{AttnMask, KvData, Rows, SeqAttn, attention_batch};
use baton_worker::kernels::cpu::dispatch::{KernelPath, Kernels};
use baton_worker::kernels::cpu::reference::AttnShape;
use baton_worker::threads::ThreadPool;

/// Arguments of `baton-bench attention`.
#[derive(clap::Args)]
pub struct Args {
    /// Thread counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// Context lengths: the chunk's last row attends this many positions.
    #[arg(long, value_delimiter = ',', default_value = "256,1024,2048,4096")]
    context: Vec<usize>,
    /// Query rows in the chunk (a prompt chunk's share of a step; 1: a decode row).
    #[arg(long, value_delimiter = ',', default_value = "64")]
    rows: Vec<usize>,
    /// Kernel paths (scalar, avx2, avx-vnni, avx512, avx512-vnni); default: every one this CPU runs.
    #[arg(long, value_delimiter = ',')]
    kernels: Vec<KernelPath>,
    /// Cache block size in positions (the paged cache's default).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Milliseconds per measurement; the median of `reps` is reported.
    #[arg(long, default_value_t = 300)]
    ms: u64,
    /// Repetitions.
    #[arg(long, default_value_t = 5)]
    reps: usize,
}

const SHAPE: AttnShape = AttnShape {
    num_heads: 9,
    num_kv_heads: 3,
    head_dim: 64,
};

/// Print one JSON line per (path, threads, context, rows).
pub fn run(args: &Args) -> Result<()> {
    if args.block_size == 0 || args.context.contains(&0) || args.rows.contains(&0) {
        bail!("--block-size, --context and --rows must be positive");
    }
    let paths = if args.kernels.is_empty() {
        Kernels::all_supported()
    } else {
        args.kernels
            .iter()
            .map(|&p| Kernels::with_path(p))
            .collect::<Result<_, _>>()?
    };
    let pools: Vec<ThreadPool> = args.threads.iter().map(|&t| ThreadPool::new(t)).collect();
    let (q_dim, kv_dim) = (SHAPE.num_heads * SHAPE.head_dim, SHAPE.num_kv_heads * SHAPE.head_dim);
    for &context in &args.context {
        for &rows in &args.rows {
            if rows > context {
                bail!("--rows {rows} exceeds --context {context}");
            }
            let blocks = context.div_ceil(args.block_size);
            // Blocks in reverse order, so consecutive positions are not consecutive in memory
            // across block boundaries, as in a cache that has served other sequences.
            let table: Vec<u32> = (0..blocks as u32).rev().collect();
            let k = noise(blocks * args.block_size * kv_dim, 1);
            let v = noise(blocks * args.block_size * kv_dim, 2);
            let q = noise(rows * q_dim, 3);
            let mut out = vec![0f32; rows * q_dim];
            let mut scores = Vec::new();
            let seq = |_: usize| SeqAttn {
                pos0: context - rows,
                rows,
                offset: 0,
                k: KvData::F32(&k),
                v: KvData::F32(&v),
                layout: Rows::Paged {
                    table: &table,
                    block_size: args.block_size,
                },
            };
            // Keys attended, over every (row, head): each costs a q·k and a p·v of head_dim.
            let attended: usize = (context - rows + 1..=context).sum::<usize>() * SHAPE.num_heads;
            let flops = (attended * 4 * SHAPE.head_dim) as f64;
            for &kern in &paths {
                for pool in &pools {
                    let mut call = || {
                        attention_batch(
                            kern,
                            pool,
                            &q,
                            1,
                            &seq,
                            context,
                            SHAPE,
                            AttnMask::Causal,
                            &mut scores,
                            &mut out,
                        )
                    };
                    let time = |call: &mut dyn FnMut(), ms: u64| {
                        let start = Instant::now();
                        let mut calls = 0u64;
                        while calls == 0 || start.elapsed() < Duration::from_millis(ms) {
                            call();
                            calls += 1;
                        }
                        start.elapsed().as_secs_f64() / calls as f64
                    };
                    time(&mut call, args.ms / 4);
                    let mut secs: Vec<f64> = (0..args.reps.max(1)).map(|_| time(&mut call, args.ms)).collect();
                    secs.sort_by(f64::total_cmp);
                    let s = secs[secs.len() / 2];
                    let line = serde_json::json!({
                        "kernel_path": kern.path().name(),
                        "threads": pool.threads(),
                        "context": context,
                        "rows": rows,
                        "us_per_call": s * 1e6,
                        "ns_per_key": s * 1e9 / attended as f64,
                        "gflop_per_s": flops / s / 1e9,
                    });
                    println!("{line}");
                }
            }
        }
    }
    Ok(())
}

fn noise(n: usize, seed: u64) -> Vec<f32> {
    baton_worker::kernels::cpu::testdata::noise(n, seed, 0.5)
}
