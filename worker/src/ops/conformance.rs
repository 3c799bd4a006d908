//! Holds any [`Ops`] implementation to the scalar reference kernels
//! ([`crate::kernels::cpu::reference`]) on seeded data, one operation at a time, so a new
//! device is checked operation by operation before the whole-model parity tests
//! (`tests/tests/backend_parity.rs`) run on it. Each check reports the largest absolute
//! difference from the reference: the CPU operations are bit-identical (0); a GPU states its
//! tolerance. Attention is checked through the backend tests, since its K/V store is the
//! device's own type.

use super::{HostMatrix, Ops};
use crate::kernels::cpu::matmul::WeightFormat;
use crate::kernels::cpu::reference as r;
use crate::kernels::cpu::testdata::noise;

/// One operation's distance from the reference.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    pub op: &'static str,
    pub max_abs_diff: f32,
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "conformance: lengths");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Every operation of `ops` but attention against the reference, on `rows` rows.
pub fn check<O: Ops>(ops: &O, rows: usize) -> Vec<Check> {
    let (cols, out_w, heads, head_dim) = (64, 48, 4, 16);
    let mut checks = Vec::new();
    let host = |buf: &O::Buf| {
        let mut v = vec![0f32; ops.len(buf)];
        ops.download(buf, &mut v);
        v
    };
    let upload = |v: &[f32]| {
        let mut b = O::Buf::default();
        ops.upload(v, &mut b);
        b
    };
    let x = noise(rows * cols, 1, 1.0);
    let xb = upload(&x);

    // Embedding gather.
    let table = noise(10 * cols, 2, 1.0);
    let t = ops
        .matrix(
            HostMatrix::F32 {
                values: table.clone(),
                cols,
            },
            WeightFormat::F32,
        )
        .expect("an f32 table uploads");
    let tokens: Vec<u32> = (0..rows as u32).map(|i| (i * 7) % 10).collect();
    let mut out = O::Buf::default();
    ops.embed(&t, &tokens, &mut out).expect("in-range tokens embed");
    let want: Vec<f32> = tokens
        .iter()
        .flat_map(|&i| table[i as usize * cols..(i as usize + 1) * cols].to_vec())
        .collect();
    checks.push(Check {
        op: "embed",
        max_abs_diff: max_diff(&host(&out), &want),
    });

    // Products, alone and sharing an input, with and without a bias.
    let w1 = noise(out_w * cols, 3, 1.0);
    let w2 = noise(cols * cols, 4, 1.0);
    let bias = noise(out_w, 5, 1.0);
    let m1 = ops
        .matrix(
            HostMatrix::F32 {
                values: w1.clone(),
                cols,
            },
            WeightFormat::F32,
        )
        .expect("uploads");
    let m2 = ops
        .matrix(
            HostMatrix::F32 {
                values: w2.clone(),
                cols,
            },
            WeightFormat::F32,
        )
        .expect("uploads");
    let b = ops.vector(bias.clone());
    let mut want1 = vec![0f32; rows * out_w];
    r::matmul_t(&x, &w1, Some(&bias), cols, &mut want1);
    let mut want2 = vec![0f32; rows * cols];
    r::matmul_t(&x, &w2, None, cols, &mut want2);
    let mut ws = O::Workspace::default();
    let mut o1 = O::Buf::default();
    ops.matmul(&mut ws, &xb, &m1, Some(&b), &mut o1);
    checks.push(Check {
        op: "matmul",
        max_abs_diff: max_diff(&host(&o1), &want1),
    });
    let (mut o1, mut o2) = (O::Buf::default(), O::Buf::default());
    ops.matmul_many(&mut ws, &xb, [(&m1, Some(&b), &mut o1), (&m2, None, &mut o2)]);
    checks.push(Check {
        op: "matmul_many",
        max_abs_diff: max_diff(&host(&o1), &want1).max(max_diff(&host(&o2), &want2)),
    });

    // Norms: whole rows, and per head in place.
    let scale = noise(cols, 6, 1.0);
    let mut want = vec![0f32; rows * cols];
    for (xr, wr) in x.chunks_exact(cols).zip(want.chunks_exact_mut(cols)) {
        r::rmsnorm(xr, &scale, 1e-6, wr);
    }
    let mut out = O::Buf::default();
    ops.rmsnorm(&xb, &ops.vector(scale), 1e-6, &mut out);
    checks.push(Check {
        op: "rmsnorm",
        max_abs_diff: max_diff(&host(&out), &want),
    });
    let head_scale = noise(head_dim, 7, 1.0);
    let mut want = x.clone();
    r::rmsnorm_inplace(&mut want, &head_scale, 1e-6);
    let mut inplace = upload(&x);
    ops.rmsnorm_inplace(&mut inplace, &ops.vector(head_scale), 1e-6);
    checks.push(Check {
        op: "rmsnorm_inplace",
        max_abs_diff: max_diff(&host(&inplace), &want),
    });

    // Rotary embedding of every head of every row.
    let half = head_dim / 2;
    let cos = noise(rows * half, 8, 1.0);
    let sin = noise(rows * half, 9, 1.0);
    let mut want = x.clone();
    for (i, row) in want.chunks_exact_mut(heads * head_dim).enumerate() {
        r::rope_rotate_half(
            row,
            head_dim,
            &cos[i * half..(i + 1) * half],
            &sin[i * half..(i + 1) * half],
        );
    }
    let mut roped = upload(&x);
    ops.rope(&mut roped, heads * head_dim, head_dim, head_dim, &cos, &sin);
    checks.push(Check {
        op: "rope",
        max_abs_diff: max_diff(&host(&roped), &want),
    });

    // SiLU-and-multiply, residual add.
    let up = noise(rows * cols, 10, 1.0);
    let mut want = x.clone();
    r::silu_mul(&mut want, &up);
    let mut gate = upload(&x);
    ops.silu_mul(&mut gate, &upload(&up), cols);
    checks.push(Check {
        op: "silu_mul",
        max_abs_diff: max_diff(&host(&gate), &want),
    });
    let want: Vec<f32> = x.iter().zip(&up).map(|(a, b)| a + b).collect();
    let mut sum = upload(&x);
    ops.add(&mut sum, &upload(&up));
    checks.push(Check {
        op: "add",
        max_abs_diff: max_diff(&host(&sum), &want),
    });

    // A mixture of experts: route, run each expert (a product) on its gathered rows, add the
    // weighted results back; against each row computed alone from the reference choice.
    let (experts, top_k) = (5, 2);
    let router = noise(rows * experts, 11, 2.0);
    let mats: Vec<Vec<f32>> = (0..experts).map(|e| noise(out_w * cols, 12 + e as u64, 1.0)).collect();
    let mut want = vec![0f32; rows * out_w];
    for (row, w) in want.chunks_exact_mut(out_w).enumerate() {
        let mut choice = r::moe_choice(&router[row * experts..(row + 1) * experts], top_k, true);
        choice.sort_by_key(|c| c.0);
        let mut y = vec![0f32; out_w];
        for (e, p) in choice {
            r::matmul_t(&x[row * cols..(row + 1) * cols], &mats[e], None, cols, &mut y);
            w.iter_mut().zip(&y).for_each(|(o, v)| *o += v * p);
        }
    }
    let mut routing = O::Routing::default();
    ops.route(&upload(&router), experts, top_k, true, &mut routing);
    let (mut packed, mut y, mut out) = (O::Buf::default(), O::Buf::default(), O::Buf::default());
    ops.zeros(&mut out, rows * out_w);
    for (e, m) in mats.iter().enumerate() {
        if ops.gather_routed(&xb, &routing, e, &mut packed) == 0 {
            continue;
        }
        let m = ops
            .matrix(
                HostMatrix::F32 {
                    values: m.clone(),
                    cols,
                },
                WeightFormat::F32,
            )
            .expect("uploads");
        ops.matmul(&mut ws, &packed, &m, None, &mut y);
        ops.scatter_routed(&y, &routing, e, &mut out);
    }
    checks.push(Check {
        op: "moe",
        max_abs_diff: max_diff(&host(&out), &want),
    });
    checks
}
