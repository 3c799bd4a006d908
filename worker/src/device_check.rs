//! `baton device-check`: what a GPU host (or, with `--dry-run`, this CPU) is checked and
//! measured on, as one JSON report. Each part runs the same code on the device under test and
//! on the CPU reference, through the public [`Ops`] and [`Backend`] interfaces:
//!
//! * `kernels`: every operation (products of f32, f16, bf16, Q8_0, Q4_0 and Q4_1 weights)
//!   against the single-thread CPU operations over batches of 1, 8, 32 and 128 rows;
//! * `parity`: whole models (logits at every position of a prompt, 180 greedy steps, so decode
//!   rows attend to more keys than one round of the attention kernel's warps covers) in f32,
//!   Q8_0, Q4_0 and f16-K/V modes against the CPU in the same mode;
//! * `batch_invariance`: a sequence's rows alone and beside others, bit for bit;
//! * `sampling`: the GPU's `sample_rows` (temperature, top-k, top-p, min-p) against the host
//!   reference of the same rule, over batches of 1, 8 and 32 rows of two vocabulary sizes;
//! * `bandwidth` and `speed`: the Q8_0 product's GB/s against the device's copy bandwidth,
//!   decode tokens/s at batch 1, 8 and 32 and a 2,048-token prefill.
//!
//! A part that fails records its error and the report goes on, so one run shows everything.

use std::path::PathBuf;
use std::time::Instant;

use baton_shared::model_files::ModelFiles;
use serde_json::{Value, json};

use crate::backend::{self, Backend, BackendOptions, Device, SampleSlot, SeqChunk};
use crate::kernels::cpu::matmul::WeightFormat;
use crate::kv_cache::KvDtype;
use crate::ops::cpu::{CpuOps, CpuOptions};
use crate::ops::{HostMatrix, Ops};
use crate::sampler::Sampler;

/// The command's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    /// The device under test (`cuda:N`); `--dry-run` tests `cpu:2` against the reference instead.
    #[arg(long, default_value = "cuda:0")]
    pub device: String,
    /// Run every step on the CPU (proves the script without a GPU).
    #[arg(long)]
    pub dry_run: bool,
    /// Models for the parity checks (Hugging Face directories or GGUF files).
    #[arg(long = "parity-model")]
    pub parity_models: Vec<PathBuf>,
    /// Models to measure decode and prefill speed on.
    #[arg(long = "speed-model")]
    pub speed_models: Vec<PathBuf>,
    /// Greedy steps compared in the parity check (after a 33-token prompt: 180 reaches 213
    /// keys, so each attention warp takes more than one tile of 32 keys).
    #[arg(long, default_value_t = 180)]
    pub greedy_steps: usize,
    /// Prefill length measured.
    #[arg(long, default_value_t = 2048)]
    pub prefill_tokens: usize,
    /// Decode batches measured.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batches: Vec<usize>,
    /// Timed decode steps per batch.
    #[arg(long, default_value_t = 32)]
    pub decode_steps: usize,
    /// Where to write the JSON report.
    #[arg(long)]
    pub out: PathBuf,
}

/// Run every part and write the report; the report is also returned.
pub fn run(a: &CheckArgs) -> anyhow::Result<Value> {
    let device: Device = if a.dry_run {
        Device::Cpu { threads: Some(2) }
    } else {
        a.device.parse()?
    };
    let mut report = serde_json::Map::new();
    report.insert("device".into(), json!(device.to_string()));
    report.insert("dry_run".into(), json!(a.dry_run));
    let started = Instant::now();
    let part = |name: &str, report: &mut serde_json::Map<String, Value>, f: &dyn Fn() -> anyhow::Result<Value>| {
        let t = Instant::now();
        let v = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => json!({ "error": format!("{e:#}") }),
            Err(_) => json!({ "error": "panicked" }),
        };
        eprintln!("device-check: {name} done in {:.1} s", t.elapsed().as_secs_f64());
        report.insert(name.into(), v);
    };
    part("kernels", &mut report, &|| kernels_on(device));
    part("bandwidth", &mut report, &|| bandwidth_on(device));
    part("sampling", &mut report, &|| sampling_on(device));
    for model in &a.parity_models {
        let name = format!("parity:{}", model.display());
        part(&name, &mut report, &|| parity(model, device, a.greedy_steps));
    }
    for model in &a.speed_models {
        let name = format!("speed:{}", model.display());
        part(&name, &mut report, &|| speed(model, device, a));
    }
    report.insert("seconds".into(), json!(started.elapsed().as_secs_f64()));
    let report = Value::Object(report);
    std::fs::write(&a.out, serde_json::to_string_pretty(&report)?)?;
    Ok(report)
}

/// Deterministic values in ±1.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `max |a - b|` and `max |b|`.
fn diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let s = b.iter().fold(0f32, |m, y| m.max(y.abs()));
    if a.len() != b.len() { (f32::INFINITY, s) } else { (d, s) }
}

/// The operations of one device, kept as a closure set so the kernel checks are written once.
fn kernels_on(device: Device) -> anyhow::Result<Value> {
    match device {
        Device::Cpu { threads } => Ok(kernel_cases(&CpuOps::new(threads.unwrap_or(2), None))),
        #[cfg(feature = "cuda")]
        Device::Cuda { gpu } => {
            let ops = crate::ops::cuda::CudaOps::open(gpu)?;
            let mut report = kernel_cases(&ops);
            let extra = q8_kernel_cases(&ops);
            if let Some(cases) = report["cases"].as_array_mut() {
                cases.extend(extra);
                let failed = cases.iter().filter(|c| c["ok"] == json!(false)).count();
                report["failed"] = json!(failed);
            }
            Ok(report)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => anyhow::bail!("this build has no CUDA backend"),
    }
}

/// Every Q8_0 kernel of the GPU against `matmul_q8` on the device, whichever the plan picks
/// for a size: the same bits (tolerance 0), with a bias, at 1, 8, 32 and 128 rows of 576
/// columns (18 blocks a row: most partials hold none) and of 4,096.
#[cfg(feature = "cuda")]
fn q8_kernel_cases(ops: &crate::ops::cuda::CudaOps) -> Vec<Value> {
    use crate::kernels::cuda::{Q8Kernel, Q8Plan};
    let reference = ops.with_q8_plan(Q8Plan::only(Q8Kernel::Dp4a));
    let mut cases = Vec::new();
    for (out_rows, cols) in [(1536usize, 576usize), (96, 4096)] {
        let w = values(out_rows * cols, 17);
        let bias = values(out_rows, 18);
        for rows in [1usize, 8, 32, 128] {
            let x = values(rows * cols, 19 + rows as u64);
            let want = matmul_on(&reference, &x, &w, cols, WeightFormat::Q8_0, Some(&bias));
            for k in Q8Kernel::ALL.into_iter().filter(|k| k.tensor_cores()) {
                let alone = ops.with_q8_plan(Q8Plan::only(k));
                let got = matmul_on(&alone, &x, &w, cols, WeightFormat::Q8_0, Some(&bias));
                let name = format!("matmul_q8_0_{}_vs_dp4a_{cols}", k.label());
                cases.push(case(&name, rows, true, &got, &want, 0.0));
            }
        }
    }
    cases
}

/// One operation over `rows` rows on `ops` and on the reference.
fn kernel_cases<O: Ops>(ops: &O) -> Value {
    let reference = CpuOps::reference();
    let mut cases = Vec::new();
    let (cols, out_rows) = (576usize, 1536usize);
    let w = values(out_rows * cols, 7);
    let bias = values(out_rows, 8);
    let norm = values(cols, 9);
    for rows in [1usize, 8, 32, 128] {
        let x = values(rows * cols, rows as u64);
        for (name, format, tol) in [
            ("matmul_f32", WeightFormat::F32, 1e-5f32),
            ("matmul_q8_0", WeightFormat::Q8_0, 1e-5),
            ("matmul_q4_0", WeightFormat::Q4_0, 1e-5),
            ("matmul_q4_1", WeightFormat::Q4_1, 1e-5),
            ("matmul_f16", WeightFormat::F16, 1e-5),
            ("matmul_bf16", WeightFormat::Bf16, 1e-5),
        ] {
            for with_bias in [false, true] {
                let run = |o: &dyn Fn(&[f32]) -> Vec<f32>| o(&x);
                let got = run(&|x| matmul_on(ops, x, &w, cols, format, with_bias.then_some(&bias[..])));
                let want = run(&|x| matmul_on(&reference, x, &w, cols, format, with_bias.then_some(&bias[..])));
                cases.push(case(name, rows, with_bias, &got, &want, tol));
            }
        }
        let got = elementwise_on(ops, &x, &norm, cols);
        let want = elementwise_on(&reference, &x, &norm, cols);
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            cases.push(case(name, rows, false, g, w, 1e-5));
        }
        // The fused forms against the plain operations on the device itself: the same bits.
        for (name, fused, plain) in fused_on(ops, &x, &norm, &w, cols) {
            cases.push(case(name, rows, false, &fused, &plain, 0.0));
        }
        // A mixture of Q8_0 (or Q4_1) experts: in one go where the device has that path,
        // against the reference going expert by expert. The gated hidden rows are quantized
        // again for the down product, so a product's last-bit difference can move a quant by
        // one step: a looser tolerance than one product's. In one go and expert by expert on
        // the device itself must agree bit for bit.
        // The one-go runs route on the device where it can (as the model does); the kernels'
        // bit-for-bit check routes on the host, and routing on the device is checked against
        // it (only the device's exp differs: an ulp or two of a weight).
        let (host, device) = (Routing::Host, Routing::Device);
        for (format, name, self_name) in [
            (WeightFormat::Q8_0, "moe_q8_experts", "moe_one_go_vs_by_expert"),
            (WeightFormat::Q4_1, "moe_q4_experts", "moe_q4_one_go_vs_by_expert"),
        ] {
            let one_go = moe_on(ops, &x, cols, format, true, device);
            let want = moe_on(&reference, &x, cols, format, false, host);
            cases.push(case(name, rows, false, &one_go, &want, 1e-3));
            let host_routed = moe_on(ops, &x, cols, format, true, host);
            let by_expert = moe_on(ops, &x, cols, format, false, host);
            cases.push(case(self_name, rows, false, &host_routed, &by_expert, 0.0));
            if format == WeightFormat::Q8_0 {
                cases.push(case("moe_device_routing", rows, false, &one_go, &host_routed, 1e-5));
            }
        }
    }
    let failed = cases.iter().filter(|c| c["ok"] == json!(false)).count();
    json!({ "cases": cases, "failed": failed })
}

/// The device's sampler against [`sample_row_reference`](crate::kernels::cuda::sample_row_reference).
/// The GPU's `exp` may differ from the host's by an ulp, which moves a weight by one unit in
/// 2^40: a row may then differ only where its draw falls that close to a boundary between two
/// tokens (or a cut that close to a token's weight). Every mismatch is listed with its row's
/// settings.
fn sampling_on(device: Device) -> anyhow::Result<Value> {
    match device {
        Device::Cpu { .. } => Ok(json!({ "skipped": "the CPU samples on the host (no device sampler to check)" })),
        #[cfg(feature = "cuda")]
        Device::Cuda { gpu } => sampling_cases(&crate::ops::cuda::CudaOps::open(gpu)?),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => anyhow::bail!("this build has no CUDA backend"),
    }
}

#[cfg(feature = "cuda")]
fn sampling_cases(ops: &crate::ops::cuda::CudaOps) -> anyhow::Result<Value> {
    use crate::kernels::cuda::{SampleRow, sample_row_reference};
    let mut cases = Vec::new();
    let mut buf = crate::ops::cuda::CudaBuf::default();
    let mut ids = Vec::new();
    for vocab in [49_152usize, 151_936] {
        for rows in [1usize, 8, 32] {
            // Logits spread like a model's (a few tokens far ahead), some repeated so cuts
            // fall inside ties.
            let mut logits: Vec<f32> = values(rows * vocab, (vocab + rows) as u64)
                .iter()
                .map(|v| v * 8.0)
                .collect();
            for (i, l) in logits.iter_mut().enumerate() {
                if i % 997 == 0 {
                    *l = 9.0;
                }
            }
            let draws = values(rows, 77 + rows as u64);
            let settings: Vec<SampleRow> = (0..rows)
                .map(|r| {
                    let pick = |options: &[f32]| options[r % options.len()];
                    SampleRow {
                        temperature: pick(&[1.0, 0.7, 1.3, 0.2]),
                        top_k: [0, 1, 40, 20, 0][r % 5],
                        top_p: pick(&[1.0, 0.9, 0.5]),
                        min_p: pick(&[0.0, 0.0, 0.05]),
                        u: draws[r].abs().min(0.999_999),
                    }
                })
                .collect();
            ops.upload(&logits, &mut buf);
            ops.sample_rows(&buf, vocab, &settings, &mut ids);
            if let Some(e) = ops.gpu().take_error() {
                anyhow::bail!("sampling {rows} rows of {vocab}: {e}");
            }
            let want: Vec<u32> = settings
                .iter()
                .enumerate()
                .map(|(r, s)| sample_row_reference(&logits[r * vocab..(r + 1) * vocab], s))
                .collect();
            let mismatches: Vec<Value> = (0..rows)
                .filter(|&r| ids[r] != want[r])
                .map(|r| json!({ "row": r, "device": ids[r], "reference": want[r], "settings": format!("{:?}", settings[r]) }))
                .collect();
            cases.push(
                json!({ "vocab": vocab, "rows": rows, "equal": rows - mismatches.len(), "mismatches": mismatches }),
            );
        }
    }
    let rows: usize = cases.iter().map(|c| c["rows"].as_u64().unwrap_or(0) as usize).sum();
    let equal: usize = cases.iter().map(|c| c["equal"].as_u64().unwrap_or(0) as usize).sum();
    Ok(json!({ "cases": cases, "rows": rows, "equal": equal }))
}

fn case(name: &str, rows: usize, bias: bool, got: &[f32], want: &[f32], tol: f32) -> Value {
    let (d, s) = diff(got, want);
    let rel = d / s.max(1e-30);
    json!({ "op": name, "rows": rows, "bias": bias, "max_abs": d, "max_rel": rel, "tolerance_rel": tol, "ok": rel <= tol })
}

fn matmul_on<O: Ops>(
    ops: &O,
    x: &[f32],
    w: &[f32],
    cols: usize,
    format: WeightFormat,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let m = ops
        .matrix(
            HostMatrix::F32 {
                values: w.to_vec(),
                cols,
            },
            format,
        )
        .expect("a valid matrix");
    let b = bias.map(|b| ops.vector(b.to_vec()));
    let (mut xb, mut out, mut ws) = (O::Buf::default(), O::Buf::default(), O::Workspace::default());
    ops.upload(x, &mut xb);
    ops.matmul(&mut ws, &xb, &m, b.as_ref(), &mut out);
    let mut host = vec![0f32; ops.len(&out)];
    ops.download(&out, &mut host);
    host
}

/// RMSNorm, per-head RMSNorm, RoPE, SiLU·up, the residual add, a mixture of experts' routing
/// and row movement, and a shared expert's gate over `x`.
fn elementwise_on<O: Ops>(ops: &O, x: &[f32], norm: &[f32], cols: usize) -> Vec<(&'static str, Vec<f32>)> {
    let rows = x.len() / cols;
    let (head_dim, half) = (64usize, 32usize);
    let cos: Vec<f32> = (0..rows * half).map(|i| (i as f32 * 0.37).cos()).collect();
    let sin: Vec<f32> = (0..rows * half).map(|i| (i as f32 * 0.37).sin()).collect();
    let y = values(x.len(), 99);
    let w = ops.vector(norm.to_vec());
    let wh = ops.vector(norm[..head_dim].to_vec());
    let get = |b: &O::Buf| {
        let mut h = vec![0f32; ops.len(b)];
        ops.download(b, &mut h);
        h
    };
    let (mut a, mut b, mut c) = (O::Buf::default(), O::Buf::default(), O::Buf::default());
    let mut out = Vec::new();
    ops.upload(x, &mut a);
    ops.rmsnorm(&a, &w, 1e-5, &mut b);
    out.push(("rmsnorm", get(&b)));
    ops.rmsnorm_inplace(&mut a, &wh, 1e-6);
    out.push(("rmsnorm_per_head", get(&a)));
    ops.upload(x, &mut a);
    ops.rope(&mut a, cols, head_dim, head_dim, &cos, &sin);
    out.push(("rope", get(&a)));
    ops.upload(x, &mut a);
    ops.rope(
        &mut a,
        cols,
        head_dim,
        head_dim / 2,
        &cos[..rows * half / 2],
        &sin[..rows * half / 2],
    );
    out.push(("rope_partial", get(&a)));
    ops.upload(x, &mut a);
    ops.upload(&y, &mut c);
    ops.silu_mul(&mut a, &c, cols);
    out.push(("silu_mul", get(&a)));
    ops.upload(x, &mut a);
    ops.add(&mut a, &c);
    out.push(("add", get(&a)));
    let table = ops
        .matrix(
            HostMatrix::F32 {
                values: y.clone(),
                cols,
            },
            WeightFormat::F32,
        )
        .expect("a valid table");
    let tokens: Vec<u32> = (0..rows as u32).rev().collect();
    ops.embed(&table, &tokens, &mut b).expect("tokens in range");
    out.push(("embed", get(&b)));
    // Six experts, two a row, each returning its rows times its own scale (the products are
    // checked above): the routing, gather and weighted scatter of every row.
    let experts = 6;
    let logits: Vec<f32> = values(rows * experts, 98).iter().map(|v| v * 4.0).collect();
    let mut routing = O::Routing::default();
    ops.upload(&logits, &mut c);
    ops.route(&c, experts, 2, true, &mut routing);
    ops.upload(x, &mut a);
    ops.zeros(&mut b, x.len());
    let (mut packed, mut scaled) = (O::Buf::default(), O::Buf::default());
    for e in 0..experts {
        let n = ops.gather_routed(&a, &routing, e, &mut packed);
        if n == 0 {
            continue;
        }
        let scale: Vec<f32> = vec![0.5 + e as f32; n * cols];
        ops.upload(&scale, &mut scaled);
        ops.add(&mut scaled, &packed);
        ops.scatter_routed(&scaled, &routing, e, &mut b);
    }
    out.push(("moe_rows", get(&b)));
    ops.upload(&y[..rows], &mut c);
    ops.upload(x, &mut b);
    ops.add_sigmoid_scaled(&mut b, &a, &c);
    out.push(("add_sigmoid_scaled", get(&b)));
    out
}

/// What one side of a fused case does to the workspace and its two buffers.
type Step<'a, O> = dyn Fn(&mut <O as Ops>::Workspace, &mut <O as Ops>::Buf, &mut <O as Ops>::Buf) + 'a;

/// Each fused operation (then a Q8_0 product over its output, which may read the quantization
/// the fused pass left) beside the plain operations it stands for, on the same device: the
/// norm, the residual add and norm, SiLU·up, q and k rotated together, and a fused norm whose
/// output is changed before the product (which must not read the stale quantization). Each
/// pair is the outputs concatenated.
fn fused_on<O: Ops>(
    ops: &O,
    x: &[f32],
    norm: &[f32],
    w: &[f32],
    cols: usize,
) -> Vec<(&'static str, Vec<f32>, Vec<f32>)> {
    let rows = x.len() / cols;
    let y = values(x.len(), 97);
    let m = ops
        .matrix(
            HostMatrix::F32 {
                values: w.to_vec(),
                cols,
            },
            WeightFormat::Q8_0,
        )
        .expect("a valid matrix");
    let wn = ops.vector(norm.to_vec());
    let get = |b: &O::Buf| {
        let mut h = vec![0f32; ops.len(b)];
        ops.download(b, &mut h);
        h
    };
    let buf = |v: &[f32]| {
        let mut b = O::Buf::default();
        ops.upload(v, &mut b);
        b
    };
    // One pass: the first buffer after `step`, the product of the second, both downloaded.
    let run = |step: &Step<'_, O>| {
        let (mut ws, mut a, mut b, mut out) = (O::Workspace::default(), buf(x), O::Buf::default(), O::Buf::default());
        step(&mut ws, &mut a, &mut b);
        ops.matmul(&mut ws, &b, &m, None, &mut out);
        [get(&a), get(&b), get(&out)].concat()
    };
    let yb = buf(&y);
    let mut out = Vec::new();
    out.push((
        "fused_rmsnorm_q8",
        run(&|ws, a, b| ops.rmsnorm_for_product(ws, a, &wn, 1e-5, b)),
        run(&|_, a, b| ops.rmsnorm(a, &wn, 1e-5, b)),
    ));
    out.push((
        "fused_add_rmsnorm_q8",
        run(&|ws, a, b| ops.add_rmsnorm_for_product(ws, a, &yb, &wn, 1e-5, b)),
        run(&|_, a, b| {
            ops.add(a, &yb);
            ops.rmsnorm(a, &wn, 1e-5, b)
        }),
    ));
    out.push((
        "fused_stale_quantization",
        run(&|ws, a, b| {
            ops.rmsnorm_for_product(ws, a, &wn, 1e-5, b);
            ops.add(b, &yb);
        }),
        run(&|_, a, b| {
            ops.rmsnorm(a, &wn, 1e-5, b);
            ops.add(b, &yb);
        }),
    ));
    out.push((
        "fused_silu_mul_q8",
        run(&|ws, _, b| {
            ops.upload(x, b);
            ops.silu_mul_for_product(ws, b, &yb, cols);
        }),
        run(&|_, _, b| {
            ops.upload(x, b);
            ops.silu_mul(b, &yb, cols);
        }),
    ));
    // Nine query heads of 64 and three key heads, half of each rotated.
    let (head_dim, k_width) = (64usize, 3 * 64usize);
    let k0 = values(rows * k_width, 96);
    let half = head_dim / 4;
    let cos: Vec<f32> = (0..rows * half).map(|i| (i as f32 * 0.29).cos()).collect();
    let sin: Vec<f32> = (0..rows * half).map(|i| (i as f32 * 0.29).sin()).collect();
    let rope = |fused: bool| {
        let (mut q, mut k) = (buf(x), buf(&k0));
        match fused {
            true => ops.rope_qk(&mut q, &mut k, (cols, k_width), head_dim, head_dim / 2, &cos, &sin),
            false => {
                ops.rope(&mut q, cols, head_dim, head_dim / 2, &cos, &sin);
                ops.rope(&mut k, k_width, head_dim, head_dim / 2, &cos, &sin);
            }
        }
        [get(&q), get(&k)].concat()
    };
    out.push(("fused_rope_qk", rope(true), rope(false)));
    out
}

/// Where [`moe_on`] routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Routing {
    /// [`Ops::route`].
    Host,
    /// [`Ops::route_on_device`] where the device can (experts in one go only).
    Device,
}

/// Six gated-MLP experts of width 256 with `format` weights, two a row, over `x`: in one go
/// ([`Ops::routed_experts`]) when `one_go` and the device has that path, else expert by expert
/// as the model runs them; routed on the device when `routing` says so and it can.
fn moe_on<O: Ops>(ops: &O, x: &[f32], cols: usize, format: WeightFormat, one_go: bool, routing: Routing) -> Vec<f32> {
    let (rows, experts, ffn) = (x.len() / cols, 6usize, 256usize);
    let mat = |r: usize, c: usize, seed: u64| {
        let values = values(r * c, seed).iter().map(|v| v * 0.1).collect();
        ops.matrix(HostMatrix::F32 { values, cols: c }, format)
            .expect("a valid matrix")
    };
    let mats: Vec<[O::Mat; 3]> = (0..experts as u64)
        .map(|e| {
            [
                mat(ffn, cols, 50 + 3 * e),
                mat(ffn, cols, 51 + 3 * e),
                mat(cols, ffn, 52 + 3 * e),
            ]
        })
        .collect();
    let refs: Vec<[&O::Mat; 3]> = mats.iter().map(|[g, u, d]| [g, u, d]).collect();
    let set = if one_go { ops.experts(&refs) } else { None };
    let (mut xb, mut logits, mut out) = (O::Buf::default(), O::Buf::default(), O::Buf::default());
    let (mut packed, mut gate, mut up, mut y) = (
        O::Buf::default(),
        O::Buf::default(),
        O::Buf::default(),
        O::Buf::default(),
    );
    let on_device = routing == Routing::Device && set.is_some() && ops.routes_on_device(experts, 2);
    let (mut routing, mut ws) = (O::Routing::default(), O::Workspace::default());
    ops.upload(x, &mut xb);
    ops.upload(
        &values(rows * experts, 97).iter().map(|v| v * 4.0).collect::<Vec<_>>(),
        &mut logits,
    );
    match on_device {
        true => ops.route_on_device(&logits, experts, 2, true, &mut routing),
        false => ops.route(&logits, experts, 2, true, &mut routing),
    }
    match &set {
        Some(set) => {
            ops.routed_experts(&mut ws, &xb, &routing, set, [&mut gate, &mut up, &mut y], &mut out);
        }
        None => {
            ops.zeros(&mut out, x.len());
            for (e, [g, u, d]) in mats.iter().enumerate() {
                if ops.gather_routed(&xb, &routing, e, &mut packed) == 0 {
                    continue;
                }
                ops.matmul_many(&mut ws, &packed, [(g, None, &mut gate), (u, None, &mut up)]);
                ops.silu_mul_for_product(&mut ws, &mut gate, &up, ffn);
                ops.matmul(&mut ws, &gate, d, None, &mut y);
                ops.scatter_routed(&y, &routing, e, &mut out);
            }
        }
    }
    let mut host = vec![0f32; ops.len(&out)];
    ops.download(&out, &mut host);
    host
}

/// Matrices (weight rows, columns) whose Q8_0 product is timed everywhere: 64 and 128 MiB.
const BANDWIDTH_SHAPES: [(usize, usize); 2] = [(8192, 8192), (16384, 8192)];
/// Timed on a GPU besides: the products of one Llama-3-8B layer (q or o, k/v, one of gate/up,
/// down), where a decode step's product time goes.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const LAYER_SHAPES: [(usize, usize); 4] = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)];

/// Copy bandwidth of the device and the Q8_0 product's GB/s on matrices of 64 and 128 MiB (on a
/// GPU also one Llama-3-8B layer's): with the kernels the operations chose for each batch size,
/// and on a GPU with each Q8_0 kernel alone, with the timings the choice was made from.
fn bandwidth_on(device: Device) -> anyhow::Result<Value> {
    match device {
        Device::Cpu { threads } => {
            let ops = CpuOps::new(threads.unwrap_or(2), None);
            let mut runs = bandwidth(&[&ops], None, 8, &BANDWIDTH_SHAPES, &[1, 8, 32]);
            Ok(json!({ "copy_gb_s": null, "q8_0_products": runs.remove(0) }))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda { gpu } => {
            use crate::kernels::cuda::{Q8Kernel, Q8Plan};
            let ops = crate::ops::cuda::CudaOps::open(gpu)?;
            let copy = ops.copy_bandwidth(1 << 30, 20)?;
            let shapes: Vec<_> = BANDWIDTH_SHAPES.iter().chain(&LAYER_SHAPES).copied().collect();
            let alone: Vec<_> = Q8Kernel::ALL
                .iter()
                .map(|&k| ops.with_q8_plan(Q8Plan::only(k)))
                .collect();
            let mut variants = vec![&ops];
            variants.extend(alone.iter());
            let mut runs = bandwidth(&variants, Some(copy), 100, &shapes, &Q8Plan::FROM_ROWS);
            let plan = runs.remove(0);
            let kernels: serde_json::Map<String, Value> = Q8Kernel::ALL
                .iter()
                .zip(runs)
                .map(|(k, run)| (k.label().to_string(), Value::Array(run)))
                .collect();
            let timed: Vec<Value> = ops
                .q8_timings()
                .iter()
                .map(|t| json!({ "kernel": t.kernel.label(), "rows": t.rows, "us": t.seconds * 1e6 }))
                .collect();
            Ok(json!({
                "copy_gb_s": copy,
                "q8_0_plan": ops.q8_plan().to_string(),
                "tensor_cores": ops.q8_plan().tensor_cores(),
                "q8_0_plan_timings": timed,
                "q8_0_products": plan,
                "q8_0_kernels": kernels,
            }))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => anyhow::bail!("this build has no CUDA backend"),
    }
}

/// Each of `variants`' Q8_0 products over `shapes` (weight rows, columns) at each of `rows`
/// activation rows: `reps` launches a point, a tenth of them from 256 rows and a fiftieth from
/// 2,048. Each matrix is
/// made once for all the variants.
fn bandwidth<O: Ops>(
    variants: &[&O],
    copy_gb_s: Option<f64>,
    reps: usize,
    shapes: &[(usize, usize)],
    rows: &[usize],
) -> Vec<Vec<Value>> {
    let mut runs = vec![Vec::new(); variants.len()];
    for &(rows_w, cols) in shapes {
        let Some(first) = variants.first() else {
            break;
        };
        let m = first
            .matrix(
                HostMatrix::F32 {
                    values: values(rows_w * cols, 3),
                    cols,
                },
                WeightFormat::Q8_0,
            )
            .expect("a valid matrix");
        let bytes = first.matrix_bytes(&m);
        for &n in rows {
            let reps = match n {
                2048.. => reps.div_ceil(50),
                256.. => reps.div_ceil(10),
                _ => reps,
            };
            let x = values(n * cols, 5);
            for (ops, run) in variants.iter().zip(&mut runs) {
                let (mut xb, mut out, mut ws) = (O::Buf::default(), O::Buf::default(), O::Workspace::default());
                ops.upload(&x, &mut xb);
                ops.matmul(&mut ws, &xb, &m, None, &mut out);
                let mut sink = vec![0f32; ops.len(&out)];
                ops.download(&out, &mut sink);
                let t = Instant::now();
                for _ in 0..reps {
                    ops.matmul(&mut ws, &xb, &m, None, &mut out);
                }
                ops.download(&out, &mut sink);
                let s = t.elapsed().as_secs_f64() / reps as f64;
                let gb_s = bytes as f64 / s / 1e9;
                run.push(json!({
                    "matrix": format!("{rows_w}x{cols} q8_0"), "bytes": bytes, "rows": n,
                    "us": s * 1e6, "gb_s": gb_s, "of_copy": copy_gb_s.map(|c| gb_s / c),
                }));
            }
        }
    }
    runs
}

/// Options for a whole-model backend on `device` with room for `seqs` sequences of `positions`.
fn options(device: Device, format: WeightFormat, kv_dtype: KvDtype, seqs: usize, positions: usize) -> BackendOptions {
    let block = 16;
    BackendOptions {
        device,
        format,
        cpu: CpuOptions::threads(1),
        check_finite: false,
        kv_blocks: seqs * positions.div_ceil(block),
        kv_block_size: block,
        kv_dtype,
        state_slots: 0,
        state_snapshots: 0,
    }
}

fn load(model: &std::path::Path, opts: &BackendOptions) -> anyhow::Result<Box<dyn Backend>> {
    let files = ModelFiles::open(model)?;
    let config = files.config()?;
    Ok(backend::load(&files, &config, 0..config.num_layers, opts)?)
}

/// One sequence's driver: its block table, where it is, and its chunks.
struct Seq {
    table: Vec<u32>,
    stored: usize,
    /// Its recurrent-state slot (its index: sequences that run together never share one).
    slot: usize,
}

impl Seq {
    fn new(index: usize, blocks: usize) -> Self {
        Self {
            table: (index * blocks..(index + 1) * blocks).map(|b| b as u32).collect(),
            stored: 0,
            slot: index,
        }
    }

    fn chunk(&self, len: usize) -> SeqChunk<'_> {
        SeqChunk {
            pos0: self.stored,
            len,
            stored: self.stored,
            table: &self.table,
            state_slot: self.slot,
            prompt_len: 0,
        }
    }
}

/// Prefill `prompt` on a fresh sequence and return the logits of every position.
fn prompt_logits(b: &mut dyn Backend, prompt: &[u32], seq: &mut Seq) -> anyhow::Result<Vec<f32>> {
    let c = b.shape().config.clone();
    let mut hidden = vec![0f32; prompt.len() * c.hidden_size];
    b.embed(prompt, &mut hidden)?;
    b.forward(&mut hidden, &[seq.chunk(prompt.len())])?;
    seq.stored += prompt.len();
    let mut logits = vec![0f32; prompt.len() * c.vocab_size];
    b.logits(&hidden, &mut logits)?;
    Ok(logits)
}

/// Greedy continuation of a sequence whose prompt is prefilled, whose last token is `last`;
/// also the logits of each step.
fn greedy(
    b: &mut dyn Backend,
    mut last: u32,
    seq: &mut Seq,
    steps: usize,
) -> anyhow::Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let c = b.shape().config.clone();
    let (mut tokens, mut all) = (Vec::new(), Vec::new());
    let mut hidden = vec![0f32; c.hidden_size];
    for _ in 0..steps {
        b.embed(&[last], &mut hidden)?;
        b.forward(&mut hidden, &[seq.chunk(1)])?;
        seq.stored += 1;
        let mut logits = vec![0f32; c.vocab_size];
        b.logits(&hidden, &mut logits)?;
        let mut slots = [SampleSlot::new(
            Sampler::new(&baton_shared::sampling::SamplingParams::greedy(1)),
            None,
        )];
        b.sample(&hidden, &mut slots)?;
        last = slots[0].token;
        tokens.push(last);
        all.push(logits);
    }
    Ok((tokens, all))
}

fn prompt_for(vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// The gap between the largest and second-largest logits.
fn top2_margin(logits: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in logits {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// A model on the device against the CPU in f32, Q8_0, Q4_0 and f16-K/V modes, and batch invariance.
///
/// f32 mode must match the CPU's f32 logits within 1e-3 and its greedy tokens exactly. A
/// quantized mode rounds activations (Q8_0, Q4_0) or cached K/V (f16), so one ulp of difference
/// before a rounding can move a value by a whole step: there the device must be as close to
/// the f32 reference as the CPU in the same mode is (within 1.5× its error, plus 1e-3), and
/// its top-1 agreement with the CPU is reported. A greedy divergence counts as a near tie when
/// the CPU's top-two gap at that step is within twice the logit difference measured.
fn parity(model: &std::path::Path, device: Device, steps: usize) -> anyhow::Result<Value> {
    let cpu = Device::Cpu { threads: Some(1) };
    let positions = 33 + steps + 1;
    let blocks = positions.div_ceil(16);
    let mut modes = Vec::new();
    let mut reference: Option<Vec<f32>> = None;
    for (mode, format, kv) in [
        ("f32", WeightFormat::F32, KvDtype::F32),
        ("q8_0", WeightFormat::Q8_0, KvDtype::F32),
        ("q4_0", WeightFormat::Q4_0, KvDtype::F32),
        ("f32_f16kv", WeightFormat::F32, KvDtype::F16),
    ] {
        let mut d = load(model, &options(device, format, kv, 1, positions))?;
        let mut r = load(model, &options(cpu, format, kv, 1, positions))?;
        let vocab = d.shape().config.vocab_size;
        let prompt = prompt_for(vocab, 33);
        let (mut sd, mut sr) = (Seq::new(0, blocks), Seq::new(0, blocks));
        let ld = prompt_logits(d.as_mut(), &prompt, &mut sd)?;
        let lr = prompt_logits(r.as_mut(), &prompt, &mut sr)?;
        let f32_reference = reference.get_or_insert_with(|| lr.clone());
        let scale = diff(&ld, &lr).1;
        let Accuracy {
            max_abs,
            device_vs_f32,
            cpu_vs_f32,
            ok,
        } = Accuracy::judge(mode == "f32", &ld, &lr, f32_reference);
        let top1 = ld
            .chunks_exact(vocab)
            .zip(lr.chunks_exact(vocab))
            .filter(|(a, b)| crate::sampler::argmax(a) == crate::sampler::argmax(b))
            .count();
        let last = *prompt.last().unwrap_or(&0);
        let (td, logits_d) = greedy(d.as_mut(), last, &mut sd, steps)?;
        let (tr, logits_r) = greedy(r.as_mut(), last, &mut sr, steps)?;
        let first_diff = td.iter().zip(&tr).position(|(a, b)| a != b);
        let divergence = first_diff.map(|i| {
            let margin = top2_margin(&logits_r[i]);
            let step_diff = diff(&logits_d[i], &logits_r[i]).0;
            json!({
                "step": i, "device": td[i], "cpu": tr[i], "cpu_top2_margin": margin,
                "device_top2_margin": top2_margin(&logits_d[i]), "logit_diff_at_step": step_diff,
                "near_tie": margin <= 2.0 * step_diff.max(max_abs),
            })
        });
        modes.push(json!({
            "mode": mode, "prompt_positions": prompt.len(), "max_abs_logit_error": max_abs, "logit_scale": scale,
            "device_vs_cpu_f32": device_vs_f32, "cpu_vs_cpu_f32": cpu_vs_f32, "ok": ok,
            "top1_agreement": format!("{top1}/{}", prompt.len()),
            "greedy_steps": steps, "greedy_equal": first_diff.is_none(), "divergence": divergence,
        }));
    }
    let invariance = batch_invariance(model, device)?;
    let long_prompt = long_prompt(model, device)?;
    Ok(json!({ "modes": modes, "batch_invariance": invariance, "long_prompt": long_prompt }))
}

/// How close a device's logits are to the CPU's in the same mode, and to the CPU's f32 ones.
struct Accuracy {
    max_abs: f32,
    device_vs_f32: f32,
    cpu_vs_f32: f32,
    ok: bool,
}

impl Accuracy {
    /// The rule of [`parity`]: the exact mode (`exact`: f32 weights and K/V) within 1e-3 of
    /// the CPU; a rounding mode as close to the f32 reference as the CPU in that mode is
    /// (within 1.5× its error, plus 1e-3).
    fn judge(exact: bool, device: &[f32], cpu: &[f32], f32_reference: &[f32]) -> Self {
        let max_abs = diff(device, cpu).0;
        let (device_vs_f32, cpu_vs_f32) = (diff(device, f32_reference).0, diff(cpu, f32_reference).0);
        let ok = match exact {
            true => max_abs <= 1e-3,
            false => device_vs_f32 <= 1.5 * cpu_vs_f32 + 1e-3,
        };
        Self {
            max_abs,
            device_vs_f32,
            cpu_vs_f32,
            ok,
        }
    }
}

/// Longest prompt [`long_prompt`] feeds: its rows attend to more keys than one round of the
/// attention kernel's warps covers (256), where the model's context allows.
const LONG_PROMPT: usize = 640;

/// A prompt of up to [`LONG_PROMPT`] tokens in one forward, logits at every position: with
/// f32 K/V within 1e-3 of the CPU, with f16 K/V as close to that reference as the CPU's own
/// f16 K/V is (the rule of [`parity`]).
fn long_prompt(model: &std::path::Path, device: Device) -> anyhow::Result<Value> {
    let cpu = Device::Cpu { threads: Some(1) };
    let files = ModelFiles::open(model)?;
    let n = files.config()?.max_position_embeddings.min(LONG_PROMPT);
    let blocks = n.div_ceil(16);
    let mut reference: Option<Vec<f32>> = None;
    let mut modes = Vec::new();
    for (mode, kv) in [("f32", KvDtype::F32), ("f32_f16kv", KvDtype::F16)] {
        let mut d = load(model, &options(device, WeightFormat::F32, kv, 1, n))?;
        let mut r = load(model, &options(cpu, WeightFormat::F32, kv, 1, n))?;
        let prompt = prompt_for(d.shape().config.vocab_size, n);
        let ld = prompt_logits(d.as_mut(), &prompt, &mut Seq::new(0, blocks))?;
        let lr = prompt_logits(r.as_mut(), &prompt, &mut Seq::new(0, blocks))?;
        let f32_reference = reference.get_or_insert_with(|| lr.clone());
        let Accuracy {
            max_abs,
            device_vs_f32,
            cpu_vs_f32,
            ok,
        } = Accuracy::judge(kv == KvDtype::F32, &ld, &lr, f32_reference);
        modes.push(json!({
            "mode": mode, "prompt_positions": n, "max_abs_logit_error": max_abs,
            "device_vs_cpu_f32": device_vs_f32, "cpu_vs_cpu_f32": cpu_vs_f32, "ok": ok,
        }));
    }
    Ok(json!(modes))
}

/// A sequence's rows computed alone and beside two others (another prefill and a decode):
/// bit for bit the same.
fn batch_invariance(model: &std::path::Path, device: Device) -> anyhow::Result<Value> {
    let positions = 64;
    let blocks = positions / 16;
    let mut b = load(model, &options(device, WeightFormat::Q8_0, KvDtype::F16, 6, positions))?;
    let c = b.shape().config.clone();
    let h = c.hidden_size;
    let a = prompt_for(c.vocab_size, 21);
    let other = prompt_for(c.vocab_size / 2, 9);
    // Alone.
    let alone = Seq::new(0, blocks);
    let mut ha = vec![0f32; a.len() * h];
    b.embed(&a, &mut ha)?;
    b.forward(&mut ha, &[alone.chunk(a.len())])?;
    // Beside others: the same prompt in a fresh sequence, between two other sequences.
    let (mut s1, mut s2, mut s3) = (Seq::new(1, blocks), Seq::new(2, blocks), Seq::new(3, blocks));
    let mut h2 = vec![0f32; other.len() * h];
    b.embed(&other, &mut h2)?;
    b.forward(&mut h2, &[s3.chunk(other.len())])?;
    s3.stored += other.len();
    let tokens: Vec<u32> = other.iter().chain(&a).chain(&other[..1]).copied().collect();
    let mut hb = vec![0f32; tokens.len() * h];
    b.embed(&tokens, &mut hb)?;
    let chunks = [s1.chunk(other.len()), s2.chunk(a.len()), s3.chunk(1)];
    b.forward(&mut hb, &chunks)?;
    s1.stored += other.len();
    s2.stored += a.len();
    let mine = &hb[other.len() * h..(other.len() + a.len()) * h];
    let equal = mine.iter().zip(&ha).all(|(x, y)| x.to_bits() == y.to_bits());
    Ok(
        json!({ "mode": "q8_0 weights, f16 K/V", "rows": a.len(), "bit_identical": equal, "max_abs": diff(mine, &ha).0 }),
    )
}

/// Decode tokens/s at each batch and a long prefill, with the weight-streaming roofline.
fn speed(model: &std::path::Path, device: Device, a: &CheckArgs) -> anyhow::Result<Value> {
    let max_batch = a.batches.iter().copied().max().unwrap_or(1);
    // The prompt, two warm-up steps, then up to four passes of `decode_steps` (graphs, without,
    // routed on the host for a mixture, timed).
    let context = 128 + 4 * a.decode_steps + 4;
    let positions = context.max(a.prefill_tokens + 1);
    let blocks = positions.div_ceil(16);
    // A Q8_0 file's blocks as stored (what `--weights auto` serves it with).
    let mut opts = options(device, WeightFormat::Native, KvDtype::F16, max_batch, positions);
    opts.kv_blocks = max_batch * blocks;
    let t = Instant::now();
    let mut b = load(model, &opts)?;
    let load_s = t.elapsed().as_secs_f64();
    let info = b.info();
    let c = b.shape().config.clone();
    let h = c.hidden_size;
    let mut decode = Vec::new();
    for &batch in &a.batches {
        let mut seqs: Vec<Seq> = (0..batch).map(|i| Seq::new(i, blocks)).collect();
        // Each sequence gets a 128-token prompt, all in one forward.
        let prompt = prompt_for(c.vocab_size, 128);
        let tokens: Vec<u32> = (0..batch).flat_map(|_| prompt.iter().copied()).collect();
        let mut hidden = vec![0f32; tokens.len() * h];
        b.embed(&tokens, &mut hidden)?;
        let chunks: Vec<SeqChunk<'_>> = seqs.iter().map(|s| s.chunk(prompt.len())).collect();
        b.forward(&mut hidden, &chunks)?;
        drop(chunks);
        seqs.iter_mut().for_each(|s| s.stored += prompt.len());
        let mut last = vec![prompt[prompt.len() - 1]; batch];
        let mut hidden = vec![0f32; batch * h];
        let mut slots: Vec<SampleSlot> = (0..batch)
            .map(|_| SampleSlot::new(Sampler::new(&baton_shared::sampling::SamplingParams::greedy(1)), None))
            .collect();
        let mut step = |b: &mut Box<dyn Backend>, seqs: &mut [Seq], last: &mut Vec<u32>| -> anyhow::Result<()> {
            b.embed(last, &mut hidden)?;
            let chunks: Vec<SeqChunk<'_>> = seqs.iter().map(|s| s.chunk(1)).collect();
            b.forward(&mut hidden, &chunks)?;
            drop(chunks);
            seqs.iter_mut().for_each(|s| s.stored += 1);
            b.sample(&hidden, &mut slots)?;
            last.iter_mut().zip(&slots).for_each(|(l, s)| *l = s.token);
            Ok(())
        };
        // Two steps before the clock: the first sizes every buffer, the second is captured
        // into a CUDA graph (where the device has them), which the timed steps replay.
        step(&mut b, &mut seqs, &mut last)?;
        step(&mut b, &mut seqs, &mut last)?;
        // Seconds for `decode_steps` steps, after `warm` untimed ones.
        let mut pass =
            |b: &mut Box<dyn Backend>, seqs: &mut [Seq], last: &mut Vec<u32>, warm: usize| -> anyhow::Result<f64> {
                for _ in 0..warm {
                    step(b, seqs, last)?;
                }
                let t = Instant::now();
                for _ in 0..a.decode_steps {
                    step(b, seqs, last)?;
                }
                Ok(t.elapsed().as_secs_f64())
            };
        let graphs_before = b.graph_counts();
        let s = pass(&mut b, &mut seqs, &mut last, 0)?;
        let graphs = b.graph_counts().zip(graphs_before).map(|(now, before)| {
            let d: Vec<u64> = now.iter().zip(before).map(|(n, b)| n - b).collect();
            json!({"eager": d[0], "captured": d[1], "replayed": d[2], "rerun": d[3]})
        });
        // The same steps with one of the device's switches off (`warm` untimed steps first),
        // then on again; `None` where the device has no such switch.
        type Switch = fn(&mut Box<dyn Backend>, bool) -> bool;
        let mut switched = |b: &mut Box<dyn Backend>,
                            seqs: &mut [Seq],
                            last: &mut Vec<u32>,
                            switch: Switch,
                            warm: usize|
         -> anyhow::Result<Option<f64>> {
            if !switch(b, false) {
                return Ok(None);
            }
            let s = pass(b, seqs, last, warm);
            switch(b, true);
            s.map(Some)
        };
        // Every kernel launched one by one (no graphs), for the ratio.
        let eager_s = switched(&mut b, &mut seqs, &mut last, |b, on| b.set_graphs(on), 0)?;
        // A mixture routed on the host (a wait per sparse layer, and no graphs), for the ratio
        // with routing on the device.
        let host_routed_s = match c.moe.is_some() {
            true => switched(&mut b, &mut seqs, &mut last, |b, on| b.set_device_routing(on), 0)?,
            false => None,
        };
        // Every quantized product on the device's reference kernel (matmul_q8) rather than the
        // kernels timed at open, for the ratio. Two untimed steps first: the graph recorded for
        // the other kernels no longer matches, so one step reruns eagerly and the next is
        // captured.
        let reference_s = switched(&mut b, &mut seqs, &mut last, |b, on| b.set_planned_products(on), 2)?;
        // Where a step's time goes on the device: the same steps again with each kernel timed
        // (events around every launch, so this pass is a little slower and not counted).
        b.kernel_times(true);
        let timed_s = pass(&mut b, &mut seqs, &mut last, 0)?;
        let kernels = b.kernel_times(false);
        let gpu_ms: f64 = kernels.iter().map(|k| k.2).sum();
        let per_step = |ms: f64| ms / a.decode_steps as f64;
        let profile = (!kernels.is_empty()).then(|| {
            json!({
                "wall_ms_per_step": timed_s * 1e3 / a.decode_steps as f64,
                "kernel_ms_per_step": per_step(gpu_ms),
                "launches_per_step": kernels.iter().map(|k| k.1).sum::<usize>() / a.decode_steps,
                "kernels": kernels.iter().map(|k| json!({"kernel": k.0, "launches_per_step": k.1 / a.decode_steps, "ms_per_step": per_step(k.2)})).collect::<Vec<_>>(),
            })
        });
        // Each step streams every weight matrix once, whatever the batch.
        let steps_s = a.decode_steps as f64 / s;
        decode.push(json!({
            "batch": batch, "steps": a.decode_steps, "tok_s": batch as f64 * steps_s,
            "ms_per_step": s * 1e3 / a.decode_steps as f64,
            "weight_gb_s": steps_s * info.matrix_bytes as f64 / 1e9,
            "graph_steps": graphs,
            "tok_s_without_graphs": eager_s.map(|e| batch as f64 * a.decode_steps as f64 / e),
            "tok_s_routed_on_host": host_routed_s.map(|e| batch as f64 * a.decode_steps as f64 / e),
            "tok_s_reference_products": reference_s.map(|e| batch as f64 * a.decode_steps as f64 / e),
            "kernel_profile": profile,
        }));
    }
    // Prefill: one sequence, the whole prompt in one forward, then its first token.
    let prompt = prompt_for(c.vocab_size, a.prefill_tokens);
    let prefill = |b: &mut Box<dyn Backend>| -> anyhow::Result<f64> {
        let seq = Seq::new(0, blocks);
        let t = Instant::now();
        let mut hidden = vec![0f32; prompt.len() * h];
        b.embed(&prompt, &mut hidden)?;
        b.forward(&mut hidden, &[seq.chunk(prompt.len())])?;
        let mut slots = [SampleSlot::new(
            Sampler::new(&baton_shared::sampling::SamplingParams::greedy(1)),
            None,
        )];
        b.sample(&hidden[(prompt.len() - 1) * h..], &mut slots)?;
        Ok(t.elapsed().as_secs_f64())
    };
    let prefill_s = prefill(&mut b)?;
    // On a device that chooses its product kernels: the prompt again with every quantized
    // product on the reference kernel, then once more as planned, for the ratio (both warm).
    let (reference_s, again_s) = match b.set_planned_products(false) {
        true => {
            let reference = prefill(&mut b)?;
            b.set_planned_products(true);
            (Some(reference), Some(prefill(&mut b)?))
        }
        false => (None, None),
    };
    let tok_s = |s: Option<f64>| s.map(|s| prompt.len() as f64 / s);
    Ok(json!({
        "model": model.display().to_string(), "layers": c.num_layers, "hidden": h, "kernels": info.kernels,
        "weights": info.weights.name(), "matrix_bytes_per_token": info.matrix_bytes, "weight_bytes": info.weight_bytes,
        "load_s": load_s, "decode": decode,
        "prefill": {
            "tokens": prompt.len(), "seconds": prefill_s, "tok_s": prompt.len() as f64 / prefill_s,
            "tok_s_again": tok_s(again_s), "tok_s_reference_products": tok_s(reference_s),
        },
    }))
}
