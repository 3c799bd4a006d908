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
use crate::kernels::cpu::half::HalfKind;

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

/// The `extern "C"` kernels a `.cu` source defines.
fn kernel_names(src: &str) -> Vec<String> {
    let mut names = Vec::new();
    for part in src.split("extern \"C\" __global__ void").skip(1) {
        let mut rest = part.trim_start();
        if let Some(after) = rest.strip_prefix("__launch_bounds__(") {
            rest = after.split_once(')').map_or("", |(_, r)| r).trim_start();
        }
        names.push(rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect());
    }
    names
}

#[test]
fn every_kernel_runs_on_the_emulation() {
    let harness = include_str!("emulation/harness.cpp");
    let sources = [
        include_str!("attention.cu"),
        include_str!("elementwise.cu"),
        include_str!("linear_attention.cu"),
        include_str!("matmul.cu"),
        include_str!("moe.cu"),
        include_str!("sampling.cu"),
    ];
    let names: Vec<String> = sources.iter().flat_map(|s| kernel_names(s)).collect();
    assert!(
        names.len() >= 35 && names.contains(&"matmul_q8_mma".to_string()),
        "{names:?}"
    );
    for name in names {
        assert!(
            harness.contains(&format!("EMULATE({name},")),
            "{name} has no entry in harness.cpp"
        );
    }
    // Every source file is one the harness includes.
    let on_disk = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/src/kernels/cuda"))
        .expect("the kernel folder")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".cu"))
        .count();
    assert_eq!(
        on_disk,
        sources.len(),
        "a new .cu file needs its place here and in harness.cpp"
    );
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
    let (grid, block) = dims(block_per_row(2, ARGMAX_THREADS));
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
    let product = |k: Q8Kernel| -> Product { kernel(k.name()) };
    // Two products of 5 and 27 rows, so 16-row tiles straddle them and end part-way. 9, 17 and
    // 33 activation rows end 8- and 32-row tiles part-way (33: a second split32 block of one
    // row). 2,048 columns: 64 blocks, two per partial; 64 columns: 2 blocks, so most partials
    // hold none; 5,120 columns: 160 blocks, five per partial, so a split kernel's warp loops
    // over its SPLIT_UNROLL blocks more than once, the last time part-way.
    for (rows_x, cols) in [(9usize, 2048usize), (17, 64), (1, 2048), (33, 5120)] {
        let x = values(rows_x * cols, 60 + rows_x as u64);
        let (xq, xd) = quantize(&x);
        let weights = [q8_matrix(5, cols, 70), q8_matrix(27, cols, 72)];
        let bias = values(27, 74);
        let run = |k: Q8Kernel| -> Vec<Vec<f32>> {
            let mut outs: Vec<Vec<f32>> = weights.iter().map(|w| vec![f32::NAN; rows_x * w.rows]).collect();
            let g = q8_group(&weights, &mut outs, &bias);
            let (grid, block) = dims(k.geometry(rows_x, 32).expect("a small grid"));
            // SAFETY: the group's addresses are live buffers of the sizes its row counts imply.
            unsafe { product(k)(grid, block, xq.as_ptr(), xd.as_ptr(), g, rows_x as i32, cols as i32) };
            outs
        };
        let want = run(Q8Kernel::Dp4a);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for k in Q8Kernel::ALL.into_iter().filter(|k| k.tensor_cores()) {
            let got = run(k);
            for p in 0..2 {
                assert!(want[p].iter().all(|v| v.is_finite()), "every output written");
                assert_eq!(
                    bits(&got[p]),
                    bits(&want[p]),
                    "{k:?}: product {p}, {rows_x} rows of {cols}"
                );
            }
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
        for (kernel_index, kind) in [(1, HalfKind::F16), (2, HalfKind::Bf16)] {
            // Two products in one launch (5 and 6 rows), the second with a bias.
            let halves: Vec<Vec<u16>> = [5usize, 6]
                .iter()
                .map(|&rows| {
                    values(rows * cols, (rows + cols) as u64)
                        .into_iter()
                        .map(|v| kind.from_f32(v))
                        .collect()
                })
                .collect();
            let wide: Vec<Vec<f32>> = halves
                .iter()
                .map(|h| h.iter().map(|&b| kind.to_f32(b)).collect())
                .collect();
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
            let half_out = run(
                kernels[kernel_index],
                [halves[0].as_ptr() as u64, halves[1].as_ptr() as u64],
            );
            assert!(
                f32_out
                    .iter()
                    .flatten()
                    .zip(half_out.iter().flatten())
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{kind:?}, {cols} wide: the half kernel must give the f32 kernel's bits"
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
    let (grid, block) = dims(block_per_row(rows.len(), SAMPLE_THREADS));
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

/// K/V values as the pool holds them: f32, or f16 bits.
#[derive(Clone, Copy, PartialEq)]
enum Pool {
    F32,
    F16,
}

#[test]
fn stored_rows_and_paged_attention_give_the_reference_rows() {
    use std::ffi::c_void;
    type Store = unsafe extern "C" fn(Dim3, Dim3, *const f32, *const f32, *mut c_void, *mut c_void, *const i32, i32);
    type Attend = unsafe extern "C" fn(
        Dim3,
        Dim3,
        *const f32,
        *const c_void,
        *const c_void,
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
    for (pool, head_dim) in [(Pool::F32, 64usize), (Pool::F32, 40), (Pool::F16, 64), (Pool::F16, 40)] {
        let (store, attend): (Store, Attend) = match pool {
            Pool::F32 => (kernel("store_kv_f32"), kernel("attention_f32")),
            Pool::F16 => (kernel("store_kv_f16"), kernel("attention_f16")),
        };
        let kv_dim = kv_heads * head_dim;
        let q = values(rows * heads * head_dim, 40 + head_dim as u64);
        let (new_k, new_v) = (values(rows * kv_dim, 43), values(rows * kv_dim, 44));
        // What the pools hold once the batch's rows are stored, as the kernels will read it.
        let round = |v: f32| match pool {
            Pool::F32 => v,
            Pool::F16 => HalfKind::F16.to_f32(HalfKind::F16.from_f32(v)),
        };
        let mut want_k: Vec<f32> = values(blocks * block_size * kv_dim, 41)
            .into_iter()
            .map(round)
            .collect();
        let mut want_v: Vec<f32> = values(blocks * block_size * kv_dim, 42)
            .into_iter()
            .map(round)
            .collect();
        let (mut kp32, mut vp32) = (want_k.clone(), want_v.clone());
        let bits = |v: &[f32]| v.iter().map(|&x| HalfKind::F16.from_f32(x)).collect::<Vec<u16>>();
        let (mut kp16, mut vp16) = (bits(&want_k), bits(&want_v));
        let (kp, vp): (*mut c_void, *mut c_void) = match pool {
            Pool::F32 => (kp32.as_mut_ptr().cast(), vp32.as_mut_ptr().cast()),
            Pool::F16 => (kp16.as_mut_ptr().cast(), vp16.as_mut_ptr().cast()),
        };
        for (t, &slot) in meta.slots.iter().enumerate() {
            let at = slot as usize * kv_dim;
            for c in 0..kv_dim {
                want_k[at + c] = round(new_k[t * kv_dim + c]);
                want_v[at + c] = round(new_v[t * kv_dim + c]);
            }
        }
        let mut out = vec![0f32; rows * heads * head_dim];
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (grid, block) = dims(copy_geometry(rows, kv_dim));
        // SAFETY: `rows` new rows of `kv_dim` go to the slots the metadata names, all inside
        // the pools; the attention reads the pools through the tables, and q and out hold
        // `rows` rows of `heads` heads.
        unsafe {
            store(
                grid,
                block,
                new_k.as_ptr(),
                new_v.as_ptr(),
                kp,
                vp,
                meta.slots.as_ptr(),
                kv_dim as i32,
            );
            let (grid, block) = dims(attention_geometry(rows, heads));
            attend(
                grid,
                block,
                q.as_ptr(),
                kp,
                vp,
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
        if pool == Pool::F32 {
            assert!(kp32 == want_k && vp32 == want_v, "stored f32 rows");
        } else {
            assert!(kp16 == bits(&want_k) && vp16 == bits(&want_v), "stored f16 rows");
        }
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
                        let k = &want_k[at(j)..][..head_dim];
                        qh.iter().zip(k).map(|(x, y)| f64::from(x * y)).sum::<f64>() * f64::from(scale)
                    })
                    .collect();
                let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                let total: f64 = p.iter().sum();
                for d in 0..head_dim {
                    let want: f64 = (0..keys).map(|j| p[j] * f64::from(want_v[at(j) + d])).sum::<f64>() / total;
                    let got = f64::from(out[(t * heads + h) * head_dim + d]);
                    assert!(
                        (got - want).abs() < 1e-5,
                        "{head_dim} wide, row {t} head {h} dim {d}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn rope_rotates_each_heads_leading_pairs() {
    type F = unsafe extern "C" fn(Dim3, Dim3, *mut f32, *const f32, *const f32, i32, i32, i32, i32);
    let run: F = kernel("rope");
    let (rows, heads, head_dim) = (3usize, 4usize, 16usize);
    let width = heads * head_dim;
    // Full rotary, and partial (a quarter of each head), as Qwen3-Next and Phi use.
    for rotary in [16usize, 4] {
        let half = rotary / 2;
        let x0 = values(rows * width, 80);
        let (cos, sin): (Vec<f32>, Vec<f32>) = values(rows * half, 81).iter().map(|a| (a.cos(), a.sin())).unzip();
        let mut x = x0.clone();
        let n = rows * heads * half;
        let (grid, block) = dims(elementwise_geometry(n));
        // SAFETY: x holds `rows` rows of `width`; the tables `rows` × `half`.
        unsafe {
            run(
                grid,
                block,
                x.as_mut_ptr(),
                cos.as_ptr(),
                sin.as_ptr(),
                rows as i32,
                width as i32,
                head_dim as i32,
                rotary as i32,
            )
        };
        let mut want = x0.clone();
        for t in 0..rows {
            for h in 0..heads {
                let at = t * width + h * head_dim;
                for p in 0..half {
                    let (a, b) = (x0[at + p], x0[at + p + half]);
                    let (c, s) = (cos[t * half + p], sin[t * half + p]);
                    want[at + p] = a * c - b * s;
                    want[at + p + half] = b * c + a * s;
                }
            }
        }
        assert_eq!(x, want, "rotary {rotary}: rotated pairs, and the rest untouched");
    }
}

#[test]
fn q4_products_match_integer_dot_products() {
    type Product = unsafe extern "C" fn(Dim3, Dim3, *const i8, *const f32, MatmulGroup, i32, i32);
    let product: Product = kernel("matmul_q4");
    let (rows_x, rows_w, cols) = (9usize, 6usize, 4608usize);
    let nb = cols / QK;
    let x = values(rows_x * cols, 90);
    let (xq, xd) = quantize(&x);
    for q4_1 in [false, true] {
        let codes: Vec<u8> = values(rows_w * nb * 16, 91)
            .iter()
            .map(|v| (v.abs() * 255.0) as u8)
            .collect();
        let f16s = |seed: u64| -> Vec<u16> {
            values(rows_w * nb, seed)
                .iter()
                .map(|v| half::f16::from_f32(v * 0.02).to_bits())
                .collect()
        };
        let w = Q4Device {
            rows: rows_w,
            cols,
            codes,
            scales: f16s(92),
            mins: if q4_1 { f16s(93) } else { Vec::new() },
        };
        let mut out = vec![0f32; rows_x * rows_w];
        let mut g = MatmulGroup::default();
        g.w[0] = w.codes.as_ptr() as u64;
        g.d[0] = w.scales.as_ptr() as u64;
        g.m[0] = if q4_1 { w.mins.as_ptr() as u64 } else { 0 };
        g.out[0] = out.as_mut_ptr() as u64;
        g.rows[0] = rows_w as i32;
        let (grid, block) = dims(matmul_geometry(rows_x, rows_w));
        // SAFETY: the group's addresses are live buffers of `rows_w` rows of `cols`.
        unsafe { product(grid, block, xq.as_ptr(), xd.as_ptr(), g, rows_x as i32, cols as i32) };
        for t in 0..rows_x {
            for r in 0..rows_w {
                let mut want = 0f64;
                for b in 0..nb {
                    let d = f64::from(half::f16::from_bits(w.scales[r * nb + b]).to_f32());
                    let m = match q4_1 {
                        true => f64::from(half::f16::from_bits(w.mins[r * nb + b]).to_f32()),
                        false => -8.0 * d,
                    };
                    let block = &w.codes[(r * nb + b) * 16..][..16];
                    // Byte j holds code j (low nibble) and code j + 16 (high).
                    let code = |k: usize| i32::from(if k < 16 { block[k] & 15 } else { block[k - 16] >> 4 });
                    let xs = &xq[t * cols + b * QK..][..QK];
                    let dot: i32 = (0..QK).map(|k| code(k) * i32::from(xs[k])).sum();
                    let sum: i32 = xs.iter().map(|&v| i32::from(v)).sum();
                    let dx = f64::from(xd[t * nb + b]);
                    want += d * dx * f64::from(dot) + m * dx * f64::from(sum);
                }
                let got = f64::from(out[t * rows_w + r]);
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "q4_1 {q4_1} row {t},{r}: {got} vs {want}"
                );
            }
        }
    }
}

/// `rmsnorm` of `x` (rows of `width`), as the unfused kernel computes it.
fn rmsnorm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    type F = unsafe extern "C" fn(Dim3, Dim3, *const f32, *const f32, *mut f32, i32, f32);
    let run: F = kernel("rmsnorm");
    let width = w.len();
    let mut out = vec![0f32; x.len()];
    let (grid, block) = dims(norm_geometry(x.len() / width, width));
    // SAFETY: x and out hold whole rows of `width`; w one row.
    unsafe { run(grid, block, x.as_ptr(), w.as_ptr(), out.as_mut_ptr(), width as i32, eps) };
    out
}

#[test]
fn the_fused_kernels_give_the_bits_of_the_kernels_they_replace() {
    type Norm =
        unsafe extern "C" fn(Dim3, Dim3, *mut f32, *const f32, *const f32, *mut f32, *mut i8, *mut f32, i32, f32);
    type Pair = unsafe extern "C" fn(Dim3, Dim3, *mut f32, *const f32, u64);
    let (fused, add): (Norm, Pair) = (kernel("rmsnorm_q8"), kernel("add"));
    // 512 wide: four warps, each quantizing four blocks of the row; 96: one warp, three blocks.
    for width in [512usize, 96] {
        let rows = 3;
        let n = rows * width;
        let (x0, y, w) = (values(n, 120), values(n, 121), values(width, 122));
        for (with_add, with_q) in [(true, true), (false, true), (true, false)] {
            // Unfused: add, rmsnorm, quantize_q8, one launch each.
            let mut want_x = x0.clone();
            if with_add {
                let (grid, block) = dims(elementwise_geometry(n));
                // SAFETY: both buffers hold `n` values.
                unsafe { add(grid, block, want_x.as_mut_ptr(), y.as_ptr(), n as u64) };
            }
            let want_out = rmsnorm_rows(&want_x, &w, 1e-5);
            let (want_q, want_d) = quantize(&want_out);
            let mut x = x0.clone();
            let mut out = vec![0f32; n];
            let (mut q, mut d) = (vec![0i8; n], vec![0f32; n / QK]);
            let (grid, block) = dims(norm_geometry(rows, width));
            let y_ptr = if with_add { y.as_ptr() } else { std::ptr::null() };
            let (q_ptr, d_ptr) = match with_q {
                true => (q.as_mut_ptr(), d.as_mut_ptr()),
                false => (std::ptr::null_mut(), std::ptr::null_mut()),
            };
            // SAFETY: x, y, out and q hold `n` values, d a scale per 32, w one row.
            unsafe {
                fused(
                    grid,
                    block,
                    x.as_mut_ptr(),
                    y_ptr,
                    w.as_ptr(),
                    out.as_mut_ptr(),
                    q_ptr,
                    d_ptr,
                    width as i32,
                    1e-5,
                )
            };
            let case = format!("width {width}, add {with_add}, quantize {with_q}");
            assert_eq!(x, want_x, "{case}: the residual");
            assert_eq!(out, want_out, "{case}: the normed rows");
            if with_q {
                assert_eq!((q, d), (want_q, want_d), "{case}: the quantized rows");
            }
        }
    }

    type Silu = unsafe extern "C" fn(Dim3, Dim3, *mut f32, *const f32, *mut i8, *mut f32, u64);
    let (silu_q8, silu): (Silu, Pair) = (kernel("silu_mul_q8"), kernel("silu_mul"));
    let n = 5 * 64;
    let (g0, up) = (values(n, 123), values(n, 124));
    let mut want = g0.clone();
    let (grid, block) = dims(elementwise_geometry(n));
    // SAFETY: both buffers hold `n` values.
    unsafe { silu(grid, block, want.as_mut_ptr(), up.as_ptr(), n as u64) };
    let (want_q, want_d) = quantize(&want);
    let mut gate = g0.clone();
    let (mut q, mut d) = (vec![0i8; n], vec![0f32; n / QK]);
    let (grid, block) = dims(quantize_geometry(n / QK));
    // SAFETY: gate, up and q hold `n` values, d a scale per 32.
    unsafe {
        silu_q8(
            grid,
            block,
            gate.as_mut_ptr(),
            up.as_ptr(),
            q.as_mut_ptr(),
            d.as_mut_ptr(),
            (n / QK) as u64,
        )
    };
    assert_eq!(gate, want, "silu·up");
    assert_eq!((q, d), (want_q, want_d), "silu·up quantized");

    type Rope = unsafe extern "C" fn(Dim3, Dim3, *mut f32, *const f32, *const f32, i32, i32, i32, i32);
    type RopeQk = unsafe extern "C" fn(Dim3, Dim3, *mut f32, *mut f32, *const f32, *const f32, i32, i32, i32, i32, i32);
    let (rope, rope_qk): (Rope, RopeQk) = (kernel("rope"), kernel("rope_qk"));
    let (rows, q_heads, k_heads, head_dim) = (3usize, 6usize, 2usize, 16usize);
    for rotary in [16usize, 8] {
        let half = rotary / 2;
        let (q0, k0) = (
            values(rows * q_heads * head_dim, 125),
            values(rows * k_heads * head_dim, 126),
        );
        let (cos, sin): (Vec<f32>, Vec<f32>) = values(rows * half, 127).iter().map(|a| (a.cos(), a.sin())).unzip();
        let (mut want_q, mut want_k) = (q0.clone(), k0.clone());
        for (x, heads) in [(&mut want_q, q_heads), (&mut want_k, k_heads)] {
            let (grid, block) = dims(elementwise_geometry(rows * heads * half));
            // SAFETY: x holds `rows` rows of `heads` heads; the tables `rows` × `half`.
            unsafe {
                rope(
                    grid,
                    block,
                    x.as_mut_ptr(),
                    cos.as_ptr(),
                    sin.as_ptr(),
                    rows as i32,
                    (heads * head_dim) as i32,
                    head_dim as i32,
                    rotary as i32,
                )
            };
        }
        let (mut q, mut k) = (q0.clone(), k0.clone());
        let (grid, block) = dims(elementwise_geometry(rows * (q_heads + k_heads) * half));
        // SAFETY: as above, for both q and k.
        unsafe {
            rope_qk(
                grid,
                block,
                q.as_mut_ptr(),
                k.as_mut_ptr(),
                cos.as_ptr(),
                sin.as_ptr(),
                rows as i32,
                q_heads as i32,
                k_heads as i32,
                head_dim as i32,
                rotary as i32,
            )
        };
        assert_eq!((q, k), (want_q, want_k), "rotary {rotary}: q and k in one launch");
    }
}

#[test]
fn the_element_wise_kernels_give_the_reference_values() {
    type Embed = unsafe extern "C" fn(Dim3, Dim3, *const f32, *const u32, *mut f32, i32);
    type Pair = unsafe extern "C" fn(Dim3, Dim3, *mut f32, *const f32, u64);
    let (embed, silu, add): (Embed, Pair, Pair) = (kernel("embed_f32"), kernel("silu_mul"), kernel("add"));
    let (vocab, cols) = (50usize, 300usize);
    let table = values(vocab * cols, 100);
    let tokens = [7u32, 0, 49, 7];
    let mut rows = vec![0f32; tokens.len() * cols];
    let (grid, block) = dims(copy_geometry(tokens.len(), cols));
    // SAFETY: every token is below `vocab`; `rows` holds one row per token.
    unsafe {
        embed(
            grid,
            block,
            table.as_ptr(),
            tokens.as_ptr(),
            rows.as_mut_ptr(),
            cols as i32,
        )
    };
    for (t, &id) in tokens.iter().enumerate() {
        assert_eq!(
            &rows[t * cols..][..cols],
            &table[id as usize * cols..][..cols],
            "token {id}"
        );
    }
    let n = rows.len();
    let other = values(n, 101);
    let (grid, block) = dims(elementwise_geometry(n));
    let mut gate = rows.clone();
    // SAFETY: both buffers hold `n` values.
    unsafe { silu(grid, block, gate.as_mut_ptr(), other.as_ptr(), n as u64) };
    for i in 0..n {
        let g = rows[i];
        let want = g / (1.0 + (-g).exp()) * other[i];
        assert!((gate[i] - want).abs() <= 1e-6 * want.abs().max(1.0), "silu·up at {i}");
    }
    let mut sum = rows.clone();
    // SAFETY: as above.
    unsafe { add(grid, block, sum.as_mut_ptr(), other.as_ptr(), n as u64) };
    assert!((0..n).all(|i| sum[i] == rows[i] + other[i]), "x += y");

    type Split = unsafe extern "C" fn(Dim3, Dim3, *const f32, *mut f32, *mut f32, i32, u64);
    let (sigmoid, split): (Pair, Split) = (kernel("sigmoid_mul"), kernel("deinterleave"));
    let mut gated = rows.clone();
    // SAFETY: both buffers hold `n` values.
    unsafe { sigmoid(grid, block, gated.as_mut_ptr(), other.as_ptr(), n as u64) };
    for i in 0..n {
        let want = rows[i] * (1.0 / (1.0 + (-other[i]).exp()));
        assert!(
            (gated[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
            "x·sigmoid(g) at {i}"
        );
    }
    // Runs of 2 × 25: the first 25 of each to a, the next 25 to b.
    let piece = 25;
    let (mut first, mut second) = (vec![0f32; n / 2], vec![0f32; n / 2]);
    let (grid, block) = dims(elementwise_geometry(n / 2));
    // SAFETY: `rows` holds `n` values, each half `n / 2`.
    unsafe {
        split(
            grid,
            block,
            rows.as_ptr(),
            first.as_mut_ptr(),
            second.as_mut_ptr(),
            piece,
            (n / 2) as u64,
        )
    };
    let runs: Vec<&[f32]> = rows.chunks(2 * piece as usize).collect();
    let want_a: Vec<f32> = runs.iter().flat_map(|r| r[..piece as usize].to_vec()).collect();
    let want_b: Vec<f32> = runs.iter().flat_map(|r| r[piece as usize..].to_vec()).collect();
    assert_eq!((first, second), (want_a, want_b), "deinterleaved halves");
}

#[test]
fn the_mixture_of_experts_kernels_move_rows_as_the_cpu_routing_says() {
    use crate::kernels::cpu::linear_attention::reference::add_sigmoid_scaled;
    use crate::kernels::cpu::moe;
    type Gather = unsafe extern "C" fn(Dim3, Dim3, *const f32, *const u32, *mut f32, i32);
    type Scatter = unsafe extern "C" fn(Dim3, Dim3, *const f32, *const u32, *const f32, *mut f32, i32);
    type Gate = unsafe extern "C" fn(Dim3, Dim3, *mut f32, *const f32, *const f32, i32);
    let (gather, scatter, gate): (Gather, Scatter, Gate) = (
        kernel("gather_rows"),
        kernel("scatter_add_rows"),
        kernel("add_sigmoid_scaled"),
    );
    // 11 rows of 300 (more than a block's threads hold, so every thread loops), 6 experts, 2 each.
    let (rows, width, experts, top_k) = (11usize, 300usize, 6usize, 2usize);
    let x = values(rows * width, 200);
    let logits: Vec<f32> = values(rows * experts, 201).iter().map(|v| v * 3.0).collect();
    let mut routing = moe::Routing::default();
    moe::route(&logits, experts, top_k, true, &mut routing);
    let (entry_rows, entry_weights) = routing.entries();
    let (mut got, mut want) = (values(rows * width, 202), vec![0f32; rows * width]);
    want.copy_from_slice(&got);
    let (mut packed, mut cpu_packed) = (vec![0f32; rows * width], vec![0f32; rows * width]);
    for e in 0..experts {
        let span = routing.span(e);
        let n = moe::gather(&x, width, &routing, e, &mut cpu_packed);
        assert_eq!(n, span.len());
        if n == 0 {
            continue;
        }
        let (grid, block) = dims(copy_geometry(n, width));
        // SAFETY: the span's rows are below `rows`; `packed` holds `n` rows of `width`.
        unsafe {
            gather(
                grid,
                block,
                x.as_ptr(),
                entry_rows[span.clone()].as_ptr(),
                packed.as_mut_ptr(),
                width as i32,
            )
        };
        assert_eq!(packed[..n * width], cpu_packed[..n * width], "expert {e}'s rows");
        // The expert's output: anything row-shaped, here its input scaled per expert.
        let y: Vec<f32> = packed[..n * width].iter().map(|v| v * (e as f32 + 0.5)).collect();
        moe::scatter_add(&y, width, &routing, e, &mut want);
        // SAFETY: as above; `got` holds `rows` rows.
        unsafe {
            scatter(
                grid,
                block,
                y.as_ptr(),
                entry_rows[span.clone()].as_ptr(),
                entry_weights[span].as_ptr(),
                got.as_mut_ptr(),
                width as i32,
            )
        };
    }
    assert!(got == want, "the weighted sums are the CPU's bits");
    // A shared expert's gate: one value per row.
    let (y, g) = (values(rows * width, 203), values(rows, 204));
    add_sigmoid_scaled(&mut want, &y, &g, width);
    let (grid, block) = dims(copy_geometry(rows, width));
    // SAFETY: `got` and `y` hold `rows` rows of `width`, `g` one value per row.
    unsafe { gate(grid, block, got.as_mut_ptr(), y.as_ptr(), g.as_ptr(), width as i32) };
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        // Only the device's exp differs: an ulp or so of the gate.
        assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "gated sum at {i}: {a} vs {b}");
    }
}

/// `route_rows` then `align_experts` over `logits`: the packed words they write (as many as
/// [`experts::device_layout`] says) and the experts with entries (what they add to the host's
/// counter, here started at 5).
fn route_on_the_emulation(logits: &[f32], experts: usize, top_k: usize, normalize: bool) -> (Vec<u32>, u32) {
    use super::experts::{align_geometry, device_layout, max_tiles, route_geometry};
    type Route = unsafe extern "C" fn(Dim3, Dim3, *const f32, *mut u32, *mut f32, i32, i32, i32);
    type Align = unsafe extern "C" fn(Dim3, Dim3, *const u32, *const f32, *mut u32, i32, i32, i32, i32, *mut u32);
    let (route, align): (Route, Align) = (kernel("route_rows"), kernel("align_experts"));
    let rows = logits.len() / experts;
    let n = rows * top_k;
    let tiles = max_tiles(n, experts);
    let (_, words) = device_layout(n, tiles);
    let (mut chosen, mut weights) = (vec![u32::MAX; n], vec![f32::NAN; n]);
    // Words the kernel must write are poisoned first.
    let mut packed = vec![0xdead_beef_u32; words];
    let (grid, block) = dims(route_geometry(rows));
    // SAFETY: `logits` holds `rows` rows of `experts`; `chosen` and `weights` `top_k` a row.
    unsafe {
        route(
            grid,
            block,
            logits.as_ptr(),
            chosen.as_mut_ptr(),
            weights.as_mut_ptr(),
            experts as i32,
            top_k as i32,
            i32::from(normalize),
        )
    };
    let (grid, block) = dims(align_geometry());
    let mut active = 5u32;
    // SAFETY: `packed` holds the layout's words for `n` entries and `tiles` tiles; `active` is
    // one word.
    unsafe {
        align(
            grid,
            block,
            chosen.as_ptr(),
            weights.as_ptr(),
            packed.as_mut_ptr(),
            rows as i32,
            top_k as i32,
            experts as i32,
            tiles as i32,
            &mut active,
        )
    };
    (packed, active - 5)
}

#[test]
fn routing_on_the_device_packs_what_the_host_routing_packs() {
    use super::experts::{ExpertPlan, device_layout, max_tiles, pack};
    use crate::kernels::cpu::moe;
    let mut routing = moe::Routing::default();
    let mut plan = ExpertPlan::default();
    let mut host = Vec::new();
    // (rows, experts, top_k, normalize): a decode row and a batch of Qwen3-30B-A3B's router,
    // Qwen3-Next's 512 experts (two row groups per expert), 300 rows over 64 experts (16
    // groups), the most experts, and a small mixture whose first expert every row takes.
    let cases = [
        (1usize, 128usize, 8usize, true),
        (32, 128, 8, true),
        (3, 512, 10, true),
        (300, 64, 4, false),
        (2, 1024, 16, true),
        (11, 5, 3, true),
    ];
    for (case, &(rows, experts, top_k, normalize)) in cases.iter().enumerate() {
        let mut logits: Vec<f32> = values(rows * experts, 400 + case as u64)
            .iter()
            .map(|v| 4.0 * v)
            .collect();
        match case {
            // Ties: row 0 all equal (the lowest experts win), row 1 equal pairs.
            1 => {
                logits[..experts].fill(0.25);
                for e in 0..experts / 2 {
                    logits[experts + 2 * e + 1] = logits[experts + 2 * e];
                }
            }
            // A -inf logit, never taken while a finite one is left.
            2 => logits[7] = f32::NEG_INFINITY,
            5 => logits.chunks_exact_mut(experts).for_each(|l| l[0] += 5.0),
            _ => {}
        }
        moe::route(&logits, experts, top_k, normalize, &mut routing);
        plan.build(&routing, experts);
        let at = pack(&routing, &plan, &mut host);
        let n = rows * top_k;
        let tiles = max_tiles(n, experts);
        let (dev_at, _) = device_layout(n, tiles);
        let (got, active) = route_on_the_emulation(&logits, experts, top_k, normalize);
        let what = format!("case {case}: {rows} rows, {top_k} of {experts}");
        assert_eq!(active as usize, plan.active, "{what}: experts with entries");
        assert_eq!(&got[..n], &host[..at.weights], "{what}: entry rows");
        // The emulation's expf is the host's exp: the same bits.
        assert_eq!(&got[n..2 * n], &host[at.weights..at.tiles], "{what}: weights");
        let used = 3 * plan.tiles.len();
        assert_eq!(
            &got[dev_at.tiles..dev_at.tiles + used],
            &host[at.tiles..at.row_entries],
            "{what}: tiles"
        );
        assert!(
            got[dev_at.tiles + used..dev_at.row_entries].iter().all(|&w| w == 0),
            "{what}: the unused tiles hold no entries"
        );
        assert_eq!(
            &got[dev_at.row_entries..],
            &host[at.row_entries..],
            "{what}: row entries"
        );
    }
}

#[test]
fn experts_in_one_go_give_the_bits_of_going_expert_by_expert() {
    experts_one_go_against_by_expert(false);
}

#[test]
fn q4_experts_in_one_go_give_the_bits_of_going_expert_by_expert() {
    experts_one_go_against_by_expert(true);
}

/// A quantized expert matrix for the mixture tests: Q8_0 quants, or Q4 codes (with minimums:
/// Q4_1), as the products read them.
struct ExpertMat {
    rows: usize,
    weights: Vec<u8>,
    scales: Vec<u16>,
    mins: Vec<u16>,
}

impl ExpertMat {
    fn q8(rows: usize, cols: usize, seed: u64) -> Self {
        let m = q8_matrix(rows, cols, seed);
        Self {
            rows,
            weights: m.quants.iter().map(|&q| q as u8).collect(),
            scales: m.scales,
            mins: Vec::new(),
        }
    }

    /// Q4_1 when `mins`, else Q4_0.
    fn q4(rows: usize, cols: usize, seed: u64, mins: bool) -> Self {
        let nb = rows * cols / QK;
        let f16s = |seed: u64| -> Vec<u16> {
            values(nb, seed)
                .iter()
                .map(|v| half::f16::from_f32(v * 0.02).to_bits())
                .collect()
        };
        Self {
            rows,
            weights: values(nb * 16, seed).iter().map(|v| (v.abs() * 255.0) as u8).collect(),
            scales: f16s(seed + 1),
            mins: if mins { f16s(seed + 2) } else { Vec::new() },
        }
    }

    /// The one-go kernels' record of this matrix (`ExpertQ8` or `ExpertQ4`) as words.
    fn record(&self, q4: bool) -> Vec<u64> {
        let mut r = vec![self.weights.as_ptr() as u64, self.scales.as_ptr() as u64];
        if q4 {
            r.push(if self.mins.is_empty() {
                0
            } else {
                self.mins.as_ptr() as u64
            });
        }
        r
    }
}

/// A launch's group of expert matrices writing into `outs` (no bias).
fn expert_group(weights: &[&ExpertMat], outs: &mut [Vec<f32>]) -> MatmulGroup {
    let mut g = MatmulGroup::default();
    for (p, (w, out)) in weights.iter().zip(outs.iter_mut()).enumerate() {
        g.w[p] = w.weights.as_ptr() as u64;
        g.d[p] = w.scales.as_ptr() as u64;
        g.m[p] = if w.mins.is_empty() { 0 } else { w.mins.as_ptr() as u64 };
        g.out[p] = out.as_mut_ptr() as u64;
        g.rows[p] = w.rows as i32;
    }
    g
}

/// A mixture of Q8_0 (or, `q4`, Q4_0 and Q4_1) experts run in one go (`matmul_q8_experts` or
/// `matmul_q4_experts`, `combine_rows`) against going expert by expert (gather, quantize, the
/// product kernel, SiLU·up, scatter): the same bits.
fn experts_one_go_against_by_expert(q4: bool) {
    use super::experts::{ExpertPlan, ExpertTile, device_layout, experts_geometry, max_tiles, pack};
    use crate::kernels::cpu::moe;
    type Product = unsafe extern "C" fn(Dim3, Dim3, *const i8, *const f32, MatmulGroup, i32, i32);
    type Experts = unsafe extern "C" fn(
        Dim3,
        Dim3,
        *const i8,
        *const f32,
        *const u64,
        *const ExpertTile,
        *const u32,
        *mut f32,
        i32,
        i32,
    );
    type Gather = unsafe extern "C" fn(Dim3, Dim3, *const f32, *const u32, *mut f32, i32);
    type Scatter = unsafe extern "C" fn(Dim3, Dim3, *const f32, *const u32, *const f32, *mut f32, i32);
    type Combine = unsafe extern "C" fn(Dim3, Dim3, *const f32, *const u32, *const f32, *mut f32, i32, i32);
    type Pair = unsafe extern "C" fn(Dim3, Dim3, *mut f32, *const f32, u64);
    let (product, grouped): (Product, Experts) = match q4 {
        false => (kernel("matmul_q8"), kernel("matmul_q8_experts")),
        true => (kernel("matmul_q4"), kernel("matmul_q4_experts")),
    };
    let (gather, scatter, combine): (Gather, Scatter, Combine) = (
        kernel("gather_rows"),
        kernel("scatter_add_rows"),
        kernel("combine_rows"),
    );
    let silu: Pair = kernel("silu_mul");
    // 11 rows, 5 experts, 3 each (so the order of a row's sum shows); expert 0 is every row's
    // first choice, so its 11 entries take a whole tile and part of another.
    let (rows, hidden, ffn, experts, top_k) = (11usize, 64usize, 96usize, 5usize, 3usize);
    let x = values(rows * hidden, 300);
    let mut logits = values(rows * experts, 301);
    logits.chunks_exact_mut(experts).for_each(|l| l[0] += 5.0);
    let mut routing = moe::Routing::default();
    moe::route(&logits, experts, top_k, true, &mut routing);
    let (entry_rows, weights) = routing.entries();
    let n = entry_rows.len();
    // Q4: odd experts Q4_1, even ones Q4_0 (a record without minimums).
    let mat = |r: usize, c: usize, seed: u64| match q4 {
        false => ExpertMat::q8(r, c, seed),
        true => ExpertMat::q4(r, c, seed, seed % 2 == 1),
    };
    let mats: Vec<[ExpertMat; 3]> = (0..experts as u64)
        .map(|e| {
            [
                mat(ffn, hidden, 310 + 10 * e + e % 2),
                mat(ffn, hidden, 313 + 10 * e + e % 2),
                mat(hidden, ffn, 316 + 10 * e + e % 2),
            ]
        })
        .collect();
    let elementwise = |len: usize| dims(elementwise_geometry(len));

    // Expert by expert, as the operations run a mixture without the one-go path.
    let mut by_expert = vec![0f32; rows * hidden];
    let mut gates = Vec::new();
    for (e, [gate, up, down]) in mats.iter().enumerate() {
        let span = routing.span(e);
        let m = span.len();
        if m == 0 {
            continue;
        }
        let mut packed = vec![0f32; m * hidden];
        let (grid, block) = dims(copy_geometry(m, hidden));
        // SAFETY: the span's rows are below `rows`; `packed` holds `m` rows.
        unsafe {
            gather(
                grid,
                block,
                x.as_ptr(),
                entry_rows[span.clone()].as_ptr(),
                packed.as_mut_ptr(),
                hidden as i32,
            )
        };
        let (pq, pd) = quantize(&packed);
        let mut outs = [vec![0f32; m * ffn], vec![0f32; m * ffn]];
        let g = expert_group(&[gate, up], &mut outs);
        let (grid, block) = dims(matmul_geometry(m, 2 * ffn));
        // SAFETY: the group's addresses are live buffers of the sizes its row counts imply.
        unsafe { product(grid, block, pq.as_ptr(), pd.as_ptr(), g, m as i32, hidden as i32) };
        let [mut h, u] = outs;
        let (grid, block) = elementwise(m * ffn);
        // SAFETY: both hold `m * ffn` values.
        unsafe { silu(grid, block, h.as_mut_ptr(), u.as_ptr(), (m * ffn) as u64) };
        gates.extend_from_slice(&h);
        let (hq, hd) = quantize(&h);
        let mut y = [vec![0f32; m * hidden]];
        let g = expert_group(&[down], &mut y);
        let (grid, block) = dims(matmul_geometry(m, hidden));
        // SAFETY: as above.
        unsafe { product(grid, block, hq.as_ptr(), hd.as_ptr(), g, m as i32, ffn as i32) };
        let (grid, block) = dims(copy_geometry(m, hidden));
        // SAFETY: as for the gather; `by_expert` holds `rows` rows.
        unsafe {
            scatter(
                grid,
                block,
                y[0].as_ptr(),
                entry_rows[span.clone()].as_ptr(),
                weights[span].as_ptr(),
                by_expert.as_mut_ptr(),
                hidden as i32,
            )
        };
    }

    // In one go: a launch per product over every expert's tiles, then one combine, reading the
    // routing packed as the CUDA operations upload it: from the host (exactly the tiles the
    // routing uses), or made on the device (grids over the most tiles it could need, the rest
    // empty; the emulation's expf is the host's exp, so the weights are the same bits).
    let mut plan = ExpertPlan::default();
    plan.build(&routing, experts);
    assert!(plan.tiles.len() > experts, "expert 0 spans two tiles");
    let mut host_packed = Vec::new();
    let host_at = pack(&routing, &plan, &mut host_packed);
    let device_tiles = max_tiles(n, experts);
    assert!(
        device_tiles > plan.tiles.len(),
        "some tiles of the device's grid are empty"
    );
    let (device_at, _) = device_layout(n, device_tiles);
    let (device_packed, _) = route_on_the_emulation(&logits, experts, top_k, true);
    let table = |i: usize| -> Vec<u64> { mats.iter().flat_map(|m| m[i].record(q4)).collect() };
    let (gate_t, up_t, down_t) = (table(0), table(1), table(2));
    let (xq, xd) = quantize(&x);
    for (packed, at, tile_count, made) in [
        (&host_packed, host_at, plan.tiles.len(), "on the host"),
        (&device_packed, device_at, device_tiles, "on the device"),
    ] {
        let entry_rows = packed.as_ptr();
        // SAFETY: the layout puts `n` weights, the tiles and the row entries at these offsets.
        let (weights, tiles, row_entries) = unsafe {
            (
                packed.as_ptr().add(at.weights) as *const f32,
                packed.as_ptr().add(at.tiles) as *const ExpertTile,
                packed.as_ptr().add(at.row_entries),
            )
        };
        let (mut h, mut u, mut y) = (
            vec![f32::NAN; n * ffn],
            vec![f32::NAN; n * ffn],
            vec![f32::NAN; n * hidden],
        );
        let (grid, block) = dims(experts_geometry(ffn, tile_count));
        // SAFETY: every tile's entries are below `n`, their rows below `rows`; `h` and `u` hold
        // `n` rows of `ffn`.
        unsafe {
            for (t, out) in [(&gate_t, &mut h), (&up_t, &mut u)] {
                grouped(
                    grid,
                    block,
                    xq.as_ptr(),
                    xd.as_ptr(),
                    t.as_ptr(),
                    tiles,
                    entry_rows,
                    out.as_mut_ptr(),
                    ffn as i32,
                    hidden as i32,
                );
            }
        }
        let (grid, block) = elementwise(n * ffn);
        // SAFETY: both hold `n * ffn` values.
        unsafe { silu(grid, block, h.as_mut_ptr(), u.as_ptr(), (n * ffn) as u64) };
        if let Some(i) = (0..h.len()).find(|&i| h[i].to_bits() != gates[i].to_bits()) {
            panic!(
                "routed {made}: the gated hidden rows, entry by entry: entry {} value {}: {} vs {}",
                i / ffn,
                i % ffn,
                h[i],
                gates[i]
            );
        }
        let (hq, hd) = quantize(&h);
        let (grid, block) = dims(experts_geometry(hidden, tile_count));
        // SAFETY: as above, the down product reading entry rows in place (no row table).
        unsafe {
            grouped(
                grid,
                block,
                hq.as_ptr(),
                hd.as_ptr(),
                down_t.as_ptr(),
                tiles,
                std::ptr::null(),
                y.as_mut_ptr(),
                hidden as i32,
                ffn as i32,
            )
        };
        let mut one_go = vec![f32::NAN; rows * hidden];
        let (grid, block) = dims(copy_geometry(rows, hidden));
        // SAFETY: `row_entries` holds `top_k` entries below `n` per row.
        unsafe {
            combine(
                grid,
                block,
                y.as_ptr(),
                row_entries,
                weights,
                one_go.as_mut_ptr(),
                top_k as i32,
                hidden as i32,
            )
        };
        assert!(one_go == by_expert, "the mixture's bits (q4 {q4}, routed {made})");
        assert!(one_go.iter().all(|v| v.is_finite() && *v != 0.0));
    }
}

/// A Gated DeltaNet shape for the tests: 2 key heads of 16, 4 value heads of 24 (not a whole
/// warp, so a block ends part-way), 4 conv taps.
fn linear_shape(tiled: bool) -> crate::ops::LinearAttnShape {
    crate::ops::LinearAttnShape {
        key_heads: 2,
        value_heads: 4,
        key_head_dim: 16,
        value_head_dim: 24,
        conv_kernel: 4,
        value_heads_tiled: tiled,
    }
}

#[test]
fn split_projections_and_the_gated_norm_match_the_cpu_operations() {
    use crate::ops::Ops;
    use crate::ops::cpu::{CpuBuf, CpuOps};
    type Split = unsafe extern "C" fn(Dim3, Dim3, *const f32, *mut f32, *mut f32, u64, i32, i32, i32, i32);
    type SplitBa = unsafe extern "C" fn(Dim3, Dim3, *const f32, *mut f32, *mut f32, u64, i32, i32);
    type Gated = unsafe extern "C" fn(Dim3, Dim3, *mut f32, *const f32, *const f32, i32, f32);
    let (split, split_ba, gated): (Split, SplitBa, Gated) =
        (kernel("split_qkvz"), kernel("split_ba"), kernel("rmsnorm_gated"));
    let shape = linear_shape(false);
    let (nk, nv, dk, dv) = (2usize, 4usize, 16usize, 24usize);
    let per_k = nv / nk;
    let rows = 5;
    let qkvz = values(rows * nk * (2 * dk + 2 * per_k * dv), 400);
    let ba = values(rows * 2 * nv, 401);
    let ops = CpuOps::reference();
    let up = |v: &[f32]| {
        let mut b = CpuBuf::default();
        ops.upload(v, &mut b);
        b
    };
    let (mut qkv, mut z, mut b, mut a) = Default::default();
    ops.split_qkvz(&up(&qkvz), &up(&ba), shape, &mut qkv, &mut z, &mut b, &mut a);
    let (mut gqkv, mut gz) = (vec![f32::NAN; qkv.len()], vec![f32::NAN; z.len()]);
    let (mut gb, mut ga) = (vec![f32::NAN; b.len()], vec![f32::NAN; a.len()]);
    let (grid, block) = dims(elementwise_geometry(qkvz.len()));
    // SAFETY: the outputs hold what `rows` rows of this shape split into.
    unsafe {
        split(
            grid,
            block,
            qkvz.as_ptr(),
            gqkv.as_mut_ptr(),
            gz.as_mut_ptr(),
            qkvz.len() as u64,
            nk as i32,
            dk as i32,
            per_k as i32,
            dv as i32,
        )
    };
    let (grid, block) = dims(elementwise_geometry(ba.len()));
    // SAFETY: as above.
    unsafe {
        split_ba(
            grid,
            block,
            ba.as_ptr(),
            gb.as_mut_ptr(),
            ga.as_mut_ptr(),
            ba.len() as u64,
            nk as i32,
            per_k as i32,
        )
    };
    assert_eq!((&gqkv[..], &gz[..]), (&qkv[..], &z[..]), "q, k, v and z");
    assert_eq!((&gb[..], &ga[..]), (&b[..], &a[..]), "b and a");

    // The gated norm over every value head of every row.
    let w = values(dv, 402);
    let mut want = z.to_vec();
    let gate = values(want.len(), 403);
    crate::kernels::cpu::linear_attention::reference::rmsnorm_gated(&mut want, &w, 1e-6, &gate);
    let mut got = z.to_vec();
    let (grid, block) = dims(copy_geometry(got.len() / dv, dv));
    // SAFETY: `got` and `gate` hold whole pieces of `dv`.
    unsafe {
        gated(
            grid,
            block,
            got.as_mut_ptr(),
            w.as_ptr(),
            gate.as_ptr(),
            dv as i32,
            1e-6,
        )
    };
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "gated norm at {i}: {g} vs {w}"
        );
    }
}

#[test]
fn linear_attention_kernels_give_the_cpu_operations_rows_and_state() {
    use super::linear::{LinearSeq, conv_geometry, delta_geometry, l2norm_geometry, linear_seqs};
    use crate::kv_cache::{PagedBatch, PagedKv, PagedSeq};
    use crate::ops::Ops;
    use crate::ops::cpu::{CpuBuf, CpuOps, CpuWorkspace};
    type Conv = unsafe extern "C" fn(
        Dim3,
        Dim3,
        *const f32,
        *mut f32,
        *const f32,
        *const LinearSeq,
        *mut f32,
        i32,
        i32,
        i32,
        i32,
        i32,
    );
    type Norm = unsafe extern "C" fn(Dim3, Dim3, *mut f32, u64, i32, i32, i32, f32);
    // delta_rule's and delta_rule_windows' parameters.
    type Delta = unsafe extern "C" fn(
        Dim3,
        Dim3,
        *const f32,
        *const f32,
        *const f32,
        *const f32,
        *const f32,
        *mut f32,
        *const LinearSeq,
        *mut f32,
        i32,
        i32,
        i32,
        i32,
        i32,
        i32,
        i32,
        i32,
        i32,
        i32,
    );
    let (conv, norm, delta, windows_kernel): (Conv, Norm, Delta, Delta) = (
        kernel("conv1d_silu"),
        kernel("l2norm_heads"),
        kernel("delta_rule"),
        kernel("delta_rule_windows"),
    );
    for tiled in [false, true] {
        let shape = linear_shape(tiled);
        let (nk, nv, dk, dv) = (2usize, 4usize, 16usize, 24usize);
        let (channels, values_w, state_values) = (shape.channels(), shape.values(), shape.state_values());
        // Sequence 0 goes on from position 5 with a state of its own (slot 2) for two rows, fewer
        // than the conv window's three (so the window shifts); sequence 1 is new (slot 0,
        // zeroed). Sequences 2 and 3 are prompt chunks that take the chunked form over whole
        // windows: 2 goes on from position 16 (slot 3) through two windows, then five rows
        // token by token; 3 from position 5 (slot 4) steps to 16, takes one window, and steps
        // from 32 on. Their state is layer 1 of two.
        let table: Vec<u32> = (0..16).collect();
        let seqs = [
            PagedSeq {
                pos0: 5,
                len: 2,
                stored: 5,
                table: &table,
                state_slot: 2,
                prompt_len: 0,
            },
            PagedSeq {
                pos0: 0,
                len: 6,
                stored: 0,
                table: &table,
                state_slot: 0,
                prompt_len: 0,
            },
            PagedSeq {
                pos0: 16,
                len: 37,
                stored: 16,
                table: &table,
                state_slot: 3,
                prompt_len: 60,
            },
            PagedSeq {
                pos0: 5,
                len: 30,
                stored: 5,
                table: &table,
                state_slot: 4,
                prompt_len: 40,
            },
        ];
        let rows = 8 + 37 + 30;
        let (state_layers, layer, slots) = (2usize, 1usize, 5usize);
        let mut pool = PagedKv::new(1, 8, 4, 16).with_states(state_layers, state_values, slots, 0);
        for slot in 0..slots {
            let s = pool.slot_state_mut(slot).expect("a slot");
            s.copy_from_slice(
                &values(s.len(), 500 + slot as u64)
                    .iter()
                    .map(|v| v * 0.3)
                    .collect::<Vec<_>>(),
            );
        }
        let qkv = values(rows * channels, 510);
        let b = values(rows * nv, 511);
        let a = values(rows * nv, 512);
        let taps = values(shape.conv_kernel * channels, 513);
        let dt_bias = values(nv, 514);
        let a_rate: Vec<f32> = values(nv, 515).iter().map(|v| -0.5 - v.abs()).collect();

        let ops = CpuOps::reference();
        let up = |v: &[f32]| {
            let mut buf = CpuBuf::default();
            ops.upload(v, &mut buf);
            buf
        };
        let mut batch = PagedBatch {
            pool: &mut pool,
            seqs: &seqs,
        };
        crate::kv_cache::KvSpans::prepare(&mut batch).expect("a valid batch");
        // The state as the GPU would hold it after prepare: every slot, back to back.
        let mut states: Vec<f32> = (0..slots)
            .flat_map(|s| batch.pool.slot_state(s).expect("a slot").to_vec())
            .collect();
        let (mut ws, mut want) = (CpuWorkspace::default(), CpuBuf::default());
        let params = [&taps, &dt_bias, &a_rate];
        ops.linear_attention(
            &mut ws,
            layer,
            &up(&qkv),
            &up(&b),
            &up(&a),
            params,
            shape,
            &mut batch,
            &mut want,
        );

        let mut lseqs = Vec::new();
        linear_seqs(&seqs, &mut lseqs);
        let windows: Vec<(i32, i32)> = lseqs.iter().map(|s| (s.win0, s.win1)).collect();
        assert_eq!(windows, [(2, 2), (6, 6), (0, 32), (11, 27)]);
        let mut conv_out = vec![f32::NAN; rows * channels];
        let (grid, block) = dims(conv_geometry(channels, lseqs.len()));
        let (sl, sv) = (state_layers as i32, state_values as i32);
        // SAFETY: each sequence's rows and state slot lie inside these buffers.
        unsafe {
            conv(
                grid,
                block,
                qkv.as_ptr(),
                conv_out.as_mut_ptr(),
                taps.as_ptr(),
                lseqs.as_ptr(),
                states.as_mut_ptr(),
                layer as i32,
                sl,
                sv,
                channels as i32,
                shape.conv_kernel as i32,
            )
        };
        let pieces = rows * 2 * nk;
        let (grid, block) = dims(l2norm_geometry(pieces));
        // SAFETY: every row holds 2 · nk heads of dk first.
        unsafe {
            norm(
                grid,
                block,
                conv_out.as_mut_ptr(),
                pieces as u64,
                nk as i32,
                dk as i32,
                channels as i32,
                1.0 / (dk as f32).sqrt(),
            )
        };
        let mut got = vec![f32::NAN; rows * values_w];
        let (grid, block) = dims(delta_geometry(nv, lseqs.len(), dv));
        let (ls, nk32, nv32, dk32, dv32, cs) = (
            layer as i32,
            nk as i32,
            nv as i32,
            dk as i32,
            dv as i32,
            shape.conv_state() as i32,
        );
        let t = i32::from(tiled);
        // As the operations launch them: the steps before the windows, the windows, the steps
        // after.
        // SAFETY: as for the conv.
        unsafe {
            let (c, bp, ap, db, ar, o) = (
                conv_out.as_ptr(),
                b.as_ptr(),
                a.as_ptr(),
                dt_bias.as_ptr(),
                a_rate.as_ptr(),
                got.as_mut_ptr(),
            );
            let (sp, st) = (lseqs.as_ptr(), states.as_mut_ptr());
            delta(
                grid, block, c, bp, ap, db, ar, o, sp, st, ls, sl, sv, cs, nk32, nv32, dk32, dv32, t, 0,
            );
            windows_kernel(
                grid, block, c, bp, ap, db, ar, o, sp, st, ls, sl, sv, cs, nk32, nv32, dk32, dv32, t, 0,
            );
            delta(
                grid, block, c, bp, ap, db, ar, o, sp, st, ls, sl, sv, cs, nk32, nv32, dk32, dv32, t, 1,
            );
        }
        // Only the exp differs (the device's against the CPU's own), an ulp or so at a time.
        let close = |g: f32, w: f32| (g - w).abs() <= 2e-5 * w.abs().max(1.0);
        for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
            assert!(
                close(*g, *w),
                "tiled {tiled}: output {} of row {}: {g} vs {w}",
                i % values_w,
                i / values_w
            );
        }
        for slot in 0..slots {
            let cpu = batch.pool.slot_state(slot).expect("a slot");
            let gpu = &states[slot * state_layers * state_values..][..state_layers * state_values];
            for (i, (g, w)) in gpu.iter().zip(cpu).enumerate() {
                assert!(close(*g, *w), "tiled {tiled}: slot {slot} state value {i}: {g} vs {w}");
            }
        }
        // Slot 1 is nobody's: untouched.
        assert_eq!(
            &states[state_layers * state_values..2 * state_layers * state_values],
            batch.pool.slot_state(1).expect("a slot")
        );
    }
}
