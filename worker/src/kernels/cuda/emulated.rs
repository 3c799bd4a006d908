//! The CUDA kernels run on the CPU emulation (`emulation/emu.h`: every thread of a block an OS
//! thread, barriers for `__syncthreads` and the shuffles), against plain Rust references. A
//! kernel's indexing, synchronisation and arithmetic are so tested on every machine, before a
//! GPU is lent; what only a GPU shows (speed, its compiler, its `exp`) is `baton
//! device-check`'s. The library is built once per test run with the system C++ compiler
//! (`$CXX`, else `c++`).

use std::process::Command;
use std::sync::OnceLock;

use libloading::Library;

use super::*;

#[repr(C)]
#[derive(Clone, Copy)]
struct Dim3 {
    x: u32,
    y: u32,
    z: u32,
}

fn dims(g: Geometry) -> (Dim3, Dim3) {
    let d = |(x, y, z): (u32, u32, u32)| Dim3 { x, y, z };
    (d(g.grid), d(g.block))
}

/// The emulated kernels, compiled on first use.
fn kernels() -> &'static Library {
    static LIBRARY: OnceLock<Library> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        let src = concat!(env!("CARGO_MANIFEST_DIR"), "/src/kernels/cuda/emulation/harness.cpp");
        let dir = tempfile::tempdir().expect("a temporary directory");
        let so = dir.path().join("libbaton_cuda_emulated.so");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = Command::new(&cxx)
            .args(["-std=c++20", "-O2", "-shared", "-fPIC", "-pthread", "-w", "-o"])
            .arg(&so)
            .arg(src)
            .output()
            .unwrap_or_else(|e| panic!("running the C++ compiler `{cxx}` for the CUDA emulation: {e}"));
        assert!(
            out.status.success(),
            "compiling the CUDA kernels for the CPU emulation failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // SAFETY: the library is ours, built just now; loading it runs no initialisers with
        // preconditions.
        unsafe { Library::new(&so) }.expect("loading the emulated kernels")
    })
}

/// Bind `emu_<name>` with the signature `F`.
fn kernel<F: Copy>(name: &str) -> F {
    let symbol = format!("emu_{name}\0");
    // SAFETY: every caller names the signature harness.cpp gives that entry point.
    unsafe { *kernels().get::<F>(symbol.as_bytes()).expect("an emulated kernel") }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = crate::sampler::Rng::new(seed);
    (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect()
}

#[test]
fn rmsnorm_gives_the_reference_rows() {
    type F = unsafe extern "C" fn(Dim3, Dim3, *const f32, *const f32, *mut f32, i32, f32);
    let run: F = kernel("rmsnorm");
    // 256 wide reads float4s; 70 wide takes the scalar loop.
    for width in [256usize, 70] {
        let rows = 3;
        let x = values(rows * width, 1);
        let w = values(width, 2);
        let mut out = vec![0f32; rows * width];
        let (grid, block) = dims(norm_geometry(rows, width));
        // SAFETY: the buffers hold `rows` rows of `width`, as the kernel reads and writes.
        unsafe {
            run(
                grid,
                block,
                x.as_ptr(),
                w.as_ptr(),
                out.as_mut_ptr(),
                width as i32,
                1e-5,
            )
        };
        for (r, row) in x.chunks(width).enumerate() {
            let ss: f32 = row.iter().map(|v| v * v).sum();
            let scale = 1.0 / (ss / width as f32 + 1e-5).sqrt();
            for c in 0..width {
                let want = row[c] * scale * w[c];
                let got = out[r * width + c];
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "row {r} col {c}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn argmax_takes_the_first_largest() {
    type F = unsafe extern "C" fn(Dim3, Dim3, *const f32, *mut u32, i32);
    let run: F = kernel("argmax_rows");
    let cols = 3000;
    let mut x = values(2 * cols, 3);
    x[17] = 5.0;
    x[2900] = 5.0;
    x[cols + 2999] = 7.0;
    let mut out = [9u32; 2];
    let g = Geometry {
        grid: (2, 1, 1),
        block: (ARGMAX_THREADS, 1, 1),
    };
    let (grid, block) = dims(g);
    // SAFETY: two rows of `cols` in, two ids out.
    unsafe { run(grid, block, x.as_ptr(), out.as_mut_ptr(), cols as i32) };
    assert_eq!(out, [17, 2999]);
}

/// `quantize_q8` over `x`: each 32-value block's quants and scale.
fn quantize(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    type F = unsafe extern "C" fn(Dim3, Dim3, *const f32, *mut i8, *mut f32, u64);
    let run: F = kernel("quantize_q8");
    let blocks = x.len() / QK;
    let (mut xq, mut xd) = (vec![0i8; x.len()], vec![0f32; blocks]);
    let (grid, block) = dims(quantize_geometry(blocks));
    // SAFETY: `blocks` blocks of 32 values in, their quants and scales out.
    unsafe { run(grid, block, x.as_ptr(), xq.as_mut_ptr(), xd.as_mut_ptr(), blocks as u64) };
    (xq, xd)
}

#[test]
fn q8_products_of_two_weights_in_one_launch_match_integer_dot_products() {
    type Product = unsafe extern "C" fn(Dim3, Dim3, *const i8, *const f32, MatmulGroup, i32, i32);
    let product: Product = kernel("matmul_q8");
    // 9 activation rows: a whole tile of 8 and one more. 32 blocks a row: a lane's loop runs
    // past its first UNROLL step only at 256 blocks, so make it 288 (9,216 columns).
    let (rows_x, cols) = (9usize, 9216usize);
    let nb = cols / QK;
    let x = values(rows_x * cols, 4);
    let (xq, xd) = quantize(&x);
    let mut q = [0i8; QK];
    for b in 0..rows_x * nb {
        let d = crate::kernels::cpu::q8::quantize_block(&x[b * QK..(b + 1) * QK], &mut q);
        assert_eq!(
            (xd[b], &xq[b * QK..(b + 1) * QK]),
            (d, &q[..]),
            "block {b} as the CPU quantizes it"
        );
    }

    // Two weight matrices (5 and 7 rows) in one group, the second with a bias.
    let weights = [q8_matrix(5, cols, 10), q8_matrix(7, cols, 12)];
    let bias = values(7, 30);
    let mut outs = [vec![0f32; rows_x * 5], vec![0f32; rows_x * 7]];
    let g = q8_group(&weights, &mut outs, &bias);
    let (grid, block) = dims(matmul_geometry(rows_x, g.total_rows()));
    // SAFETY: the group's addresses are live buffers of the sizes its row counts imply.
    unsafe { product(grid, block, xq.as_ptr(), xd.as_ptr(), g, rows_x as i32, cols as i32) };
    for (p, w) in weights.iter().enumerate() {
        for t in 0..rows_x {
            for r in 0..w.rows {
                let mut want = if p == 1 { bias[r] } else { 0.0 } as f64;
                for b in 0..nb {
                    let dot: i32 = (0..QK)
                        .map(|i| i32::from(w.quants[r * cols + b * QK + i]) * i32::from(xq[t * cols + b * QK + i]))
                        .sum();
                    let scale = half::f16::from_bits(w.scales[r * nb + b]).to_f32() * xd[t * nb + b];
                    want += f64::from(scale) * f64::from(dot);
                }
                let got = f64::from(outs[p][t * w.rows + r]);
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "product {p} row {t},{r}: {got} vs {want}"
                );
            }
        }
    }
}

/// A Q8_0 matrix of random quants and scales.
fn q8_matrix(rows: usize, cols: usize, seed: u64) -> Q8Device {
    let nb = cols / QK;
    Q8Device {
        rows,
        cols,
        quants: values(rows * cols, seed).iter().map(|&f| (f * 127.0) as i8).collect(),
        scales: values(rows * nb, seed + 1)
            .iter()
            .map(|&s| half::f16::from_f32(s * 0.01).to_bits())
            .collect(),
    }
}

/// A launch's group of Q8_0 `weights` writing into `outs`, the second product with `bias`.
fn q8_group(weights: &[Q8Device], outs: &mut [Vec<f32>], bias: &[f32]) -> MatmulGroup {
    let mut g = MatmulGroup::default();
    for (p, (w, out)) in weights.iter().zip(outs.iter_mut()).enumerate() {
        g.w[p] = w.quants.as_ptr() as u64;
        g.d[p] = w.scales.as_ptr() as u64;
        g.out[p] = out.as_mut_ptr() as u64;
        g.rows[p] = w.rows as i32;
    }
    g.bias[1] = bias.as_ptr() as u64;
    g
}

#[test]
fn tensor_core_q8_products_give_the_dp4a_kernels_bits() {
    type Product = unsafe extern "C" fn(Dim3, Dim3, *const i8, *const f32, MatmulGroup, i32, i32);
    let (dp4a, mma): (Product, Product) = (kernel("matmul_q8"), kernel("matmul_q8_mma"));
    // Two products of 5 and 27 rows, so 16-row tiles straddle them and end part-way; 9 and 17
    // activation rows end 8-row tiles part-way. 2,048 columns: 64 blocks, two per partial;
    // 64 columns: 2 blocks, so most partials hold none.
    for (rows_x, cols) in [(9usize, 2048usize), (17, 64), (1, 2048)] {
        let x = values(rows_x * cols, 60 + rows_x as u64);
        let (xq, xd) = quantize(&x);
        let weights = [q8_matrix(5, cols, 70), q8_matrix(27, cols, 72)];
        let bias = values(27, 74);
        let run = |k: Product, geometry: Geometry| -> Vec<Vec<f32>> {
            let mut outs: Vec<Vec<f32>> = weights.iter().map(|w| vec![f32::NAN; rows_x * w.rows]).collect();
            let g = q8_group(&weights, &mut outs, &bias);
            let (grid, block) = dims(geometry);
            // SAFETY: the group's addresses are live buffers of the sizes its row counts imply.
            unsafe { k(grid, block, xq.as_ptr(), xd.as_ptr(), g, rows_x as i32, cols as i32) };
            outs
        };
        let want = run(dp4a, matmul_geometry(rows_x, 32));
        let got = run(mma, matmul_mma_geometry(rows_x, 32));
        for p in 0..2 {
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert!(want[p].iter().all(|v| v.is_finite()), "every output written");
            assert_eq!(bits(&got[p]), bits(&want[p]), "product {p}, {rows_x} rows of {cols}");
        }
    }
}

#[test]
fn half_precision_products_equal_f32_products_of_the_rounded_weights() {
    type Product = unsafe extern "C" fn(Dim3, Dim3, *const f32, MatmulGroup, i32, i32);
    let kernels: [Product; 3] = [kernel("matmul_f32"), kernel("matmul_f16"), kernel("matmul_bf16")];
    let rows_x = 9;
    // 260 wide reads four values a lane at a time (and each lane more than once); 70 one.
    for cols in [260usize, 70] {
        let x = values(rows_x * cols, 50);
        let bias = values(6, 51);
        for (kind, round) in [
            (1, (|v| half::f16::from_f32(v).to_bits()) as fn(f32) -> u16),
            (2, |v| half::bf16::from_f32(v).to_bits()),
        ] {
            let widen = |b: u16| match kind {
                1 => half::f16::from_bits(b).to_f32(),
                _ => half::bf16::from_bits(b).to_f32(),
            };
            // Two products in one launch (5 and 6 rows), the second with a bias.
            let halves: Vec<Vec<u16>> = [5usize, 6]
                .iter()
                .map(|&rows| {
                    values(rows * cols, (rows + cols) as u64)
                        .into_iter()
                        .map(round)
                        .collect()
                })
                .collect();
            let wide: Vec<Vec<f32>> = halves.iter().map(|h| h.iter().map(|&b| widen(b)).collect()).collect();
            let run = |k: Product, weights: [u64; 2]| -> Vec<Vec<f32>> {
                let mut outs = vec![vec![0f32; rows_x * 5], vec![0f32; rows_x * 6]];
                let mut g = MatmulGroup::default();
                for p in 0..2 {
                    g.w[p] = weights[p];
                    g.out[p] = outs[p].as_mut_ptr() as u64;
                    g.rows[p] = [5, 6][p];
                }
                g.bias[1] = bias.as_ptr() as u64;
                let (grid, block) = dims(matmul_geometry(rows_x, g.total_rows()));
                // SAFETY: the group's addresses are live buffers of its rows times `cols`.
                unsafe { k(grid, block, x.as_ptr(), g, rows_x as i32, cols as i32) };
                outs
            };
            let f32_out = run(kernels[0], [wide[0].as_ptr() as u64, wide[1].as_ptr() as u64]);
            let half_out = run(kernels[kind], [halves[0].as_ptr() as u64, halves[1].as_ptr() as u64]);
            assert!(
                f32_out
                    .iter()
                    .flatten()
                    .zip(half_out.iter().flatten())
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "kind {kind}, {cols} wide: the half kernel must give the f32 kernel's bits"
            );
            for (p, w) in wide.iter().enumerate() {
                let rows = w.len() / cols;
                for t in 0..rows_x {
                    for r in 0..rows {
                        let dot: f64 = (0..cols)
                            .map(|c| f64::from(w[r * cols + c]) * f64::from(x[t * cols + c]))
                            .sum();
                        let want = dot + if p == 1 { f64::from(bias[r]) } else { 0.0 };
                        let got = f64::from(f32_out[p][t * rows + r]);
                        assert!((got - want).abs() < 1e-5, "product {p} row {t},{r}: {got} vs {want}");
                    }
                }
            }
        }
    }
}

type Sample = unsafe extern "C" fn(Dim3, Dim3, *const f32, *const SampleRow, *mut u32, i32);

/// `sample_rows` over `logits` (rows of `vocab`), one launch.
fn sample(logits: &[f32], vocab: usize, rows: &[SampleRow]) -> Vec<u32> {
    let run: Sample = kernel("sample_rows");
    let mut out = vec![u32::MAX; rows.len()];
    let (grid, block) = dims(sample_geometry(rows.len()));
    // SAFETY: a row of `vocab` logits and one setting per output id.
    unsafe {
        run(
            grid,
            block,
            logits.as_ptr(),
            rows.as_ptr(),
            out.as_mut_ptr(),
            vocab as i32,
        )
    };
    out
}

fn row(temperature: f32, top_k: i32, top_p: f32, min_p: f32, u: f32) -> SampleRow {
    SampleRow {
        temperature,
        top_k,
        top_p,
        min_p,
        u,
    }
}

#[test]
fn sampling_on_the_device_cuts_where_the_reference_does() {
    // Three tokens ahead (ids 10, 20, 30), ten tied just behind them at the top of the id range
    // (4000-4004, one thread's share, then 4500, 4600, ..., 4900), the rest far behind, one NaN
    // and one that weighs 0. A draw just under 1 takes the last kept token in id order, so it
    // shows exactly where a cut fell.
    let vocab = 5000;
    let mut logits: Vec<f32> = values(vocab, 5).iter().map(|v| v * 4.0 - 10.0).collect();
    (logits[10], logits[20], logits[30]) = (6.0, 5.5, 5.2);
    for i in (4000..4005).chain((4500..5000).step_by(100)) {
        logits[i] = 5.0;
    }
    logits[4321] = -90.0;
    logits[11] = f32::NAN;
    let last = 0.999_999_9;
    let cases = [
        (SampleRow::GREEDY, 10),
        (row(1.0, 5, 1.0, 0.0, last), 4001),   // top-k cuts inside the tie
        (row(1.0, 13, 1.0, 0.0, last), 4900),  // top-k keeps all of it
        (row(1.0, 0, 0.6, 0.0, last), 4003),   // top-p cuts inside the tie
        (row(1.0, 0, 0.75, 0.0, last), 4600),  // and after its first thread's share
        (row(1.0, 12, 0.95, 0.0, last), 4800), // top-p past top-k's cut keeps top-k's
        (row(1.0, 0, 0.05, 0.0, last), 10),    // top-p keeps at least the first
        (row(1.0, 0, 1.0, 0.4, last), 30),     // min-p keeps 1, 0.61 and 0.45, not the 0.37s
        (row(0.5, 0, 1.0, 0.15, last), 30),    // colder: 30 at 0.20 of the top, the tie 0.135
        (row(0.5, 0, 1.0, 0.1, last), 4900),
        (row(1.0, 0, 1.0, 0.0, 0.0), 0), // even far behind, token 0 weighs more than 0
    ];
    let settings: Vec<SampleRow> = cases.iter().map(|c| c.0).collect();
    let n = settings.len();
    let all: Vec<f32> = logits.iter().copied().cycle().take(n * vocab).collect();
    let got = sample(&all, vocab, &settings);
    let want: Vec<u32> = settings.iter().map(|s| sample_row_reference(&logits, s)).collect();
    assert_eq!(got, want, "device against the reference");
    assert_eq!(
        want,
        cases.iter().map(|c| c.1).collect::<Vec<u32>>(),
        "the reference against the cuts"
    );
}

#[test]
fn sampling_a_small_vocabulary_and_draws_across_it() {
    // Fewer tokens than threads (most threads hold none), and draws spread over [0, 1): each
    // must land on the reference's token, so the kept set and its weights are the same.
    let vocab = 300;
    let mut logits: Vec<f32> = values(vocab, 6).iter().map(|v| v * 3.0).collect();
    for i in (0..vocab).step_by(7) {
        logits[i] = 1.5; // ties, some at the cuts
    }
    let mut settings = Vec::new();
    for (i, u) in [0.0f32, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 0.99, 0.999_999_9]
        .iter()
        .enumerate()
    {
        for (top_k, top_p) in [(0, 1.0), (3, 1.0), (50, 0.6), (0, 0.95), (20, 0.3)] {
            settings.push(row(0.8 + 0.1 * i as f32, top_k, top_p, [0.0, 0.05][i % 2], *u));
        }
    }
    let all: Vec<f32> = logits.iter().copied().cycle().take(settings.len() * vocab).collect();
    let got = sample(&all, vocab, &settings);
    let want: Vec<u32> = settings.iter().map(|s| sample_row_reference(&logits, s)).collect();
    assert_eq!(got, want);
}

#[test]
fn paged_attention_gives_the_reference_rows() {
    type F = unsafe extern "C" fn(
        Dim3,
        Dim3,
        *const f32,
        *const f32,
        *const f32,
        *const i32,
        *const u32,
        *mut f32,
        i32,
        i32,
        i32,
        i32,
        i32,
        f32,
    );
    let run: F = kernel("attention_f32");
    let (heads, kv_heads, block_size, blocks) = (4usize, 2usize, 16usize, 24usize);
    // Two decode-like rows 300 keys in (more keys than the block's eight warps take in one
    // round of 32-key tiles) beside a 40-row prompt chunk; tables out of order.
    let (a, b): (Vec<u32>, Vec<u32>) = ((0..19).rev().collect(), vec![23, 19, 21]);
    let seqs = [
        crate::kv_cache::PagedSeq {
            pos0: 298,
            len: 2,
            stored: 298,
            table: &a,
            state_slot: 0,
            prompt_len: 0,
        },
        crate::kv_cache::PagedSeq {
            pos0: 0,
            len: 40,
            stored: 0,
            table: &b,
            state_slot: 1,
            prompt_len: 0,
        },
    ];
    let mut meta = BatchMeta::default();
    meta.build(&seqs, block_size);
    let rows = meta.rows.len() / META_WIDTH;
    // 64 wide takes the kernel's compiled width; 40 its general loop.
    for head_dim in [64usize, 40] {
        let kv_dim = kv_heads * head_dim;
        let q = values(rows * heads * head_dim, 40 + head_dim as u64);
        let kp = values(blocks * block_size * kv_dim, 41);
        let vp = values(blocks * block_size * kv_dim, 42);
        let mut out = vec![0f32; rows * heads * head_dim];
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (grid, block) = dims(attention_geometry(rows, heads));
        // SAFETY: the pools hold `blocks` blocks, the tables name only those, and q and out
        // hold `rows` rows of `heads` heads.
        unsafe {
            run(
                grid,
                block,
                q.as_ptr(),
                kp.as_ptr(),
                vp.as_ptr(),
                meta.rows.as_ptr(),
                meta.tables.as_ptr(),
                out.as_mut_ptr(),
                heads as i32,
                kv_heads as i32,
                head_dim as i32,
                block_size as i32,
                0,
                scale,
            )
        };
        for t in 0..rows {
            let m = &meta.rows[t * META_WIDTH..(t + 1) * META_WIDTH];
            let (keys, table) = (m[1] as usize, &meta.tables[m[3] as usize..]);
            for h in 0..heads {
                let kvh = h / (heads / kv_heads);
                let qh = &q[(t * heads + h) * head_dim..][..head_dim];
                let at =
                    |j: usize| (table[j / block_size] as usize * block_size + j % block_size) * kv_dim + kvh * head_dim;
                let scores: Vec<f64> = (0..keys)
                    .map(|j| {
                        let k = &kp[at(j)..][..head_dim];
                        qh.iter().zip(k).map(|(x, y)| f64::from(x * y)).sum::<f64>() * f64::from(scale)
                    })
                    .collect();
                let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                let total: f64 = p.iter().sum();
                for d in 0..head_dim {
                    let want: f64 = (0..keys).map(|j| p[j] * f64::from(vp[at(j) + d])).sum::<f64>() / total;
                    let got = f64::from(out[(t * heads + h) * head_dim + d]);
                    assert!(
                        (got - want).abs() < 1e-5,
                        "head_dim {head_dim} row {t} head {h} dim {d}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
