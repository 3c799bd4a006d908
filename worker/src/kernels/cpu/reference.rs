//! fp32 reference kernels: plain functions over slices, written so the compiler can vectorise
//! them (fixed-width partial sums), allocating nothing. No `mul_add`: without a target FMA it
//! becomes a libm call per element.

/// Lanes of partial sums in [`dot`]; a fixed width lets LLVM keep them in vector registers.
pub const LANES: usize = 16;

/// Dot product with `LANES` interleaved partial sums.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    let (ac, ar) = a.split_at(a.len() / LANES * LANES);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(LANES).zip(bc.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ar.iter().zip(br) {
        tail += x * y;
    }
    reduce_lanes(acc) + tail
}

/// The pairwise sum of [`dot`]'s partial sums (lane l + lane l+8, then +4, +2, +1), which keeps
/// rounding error low; every twin of `dot` reduces in exactly this order.
#[inline(always)]
pub fn reduce_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}

/// `out[t][r] = x[t] · w[r] (+ bias[r])` for `t` rows of `x` (each `cols` long) and a row-major
/// weight `w` of `rows × cols`. Rows of `w` are the outer loop so each is read once per batch.
pub fn matmul_t(x: &[f32], w: &[f32], bias: Option<&[f32]>, cols: usize, out: &mut [f32]) {
    let t = x.len() / cols;
    let rows = w.len() / cols;
    debug_assert_eq!(out.len(), t * rows);
    for (r, wr) in w.chunks_exact(cols).enumerate() {
        let b = bias.map_or(0.0, |b| b[r]);
        for (i, xr) in x.chunks_exact(cols).enumerate() {
            out[i * rows + r] = dot(xr, wr) + b;
        }
    }
}

/// RMSNorm of each `weight.len()`-wide row of `x` into `out`: `x / sqrt(mean(x²) + eps) * weight`.
#[inline(always)]
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let ss = dot(xr, xr) / n as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(weight) {
            *o = g * (v * inv);
        }
    }
}

/// In-place RMSNorm of each `weight.len()`-wide row (per-head q/k norm).
#[inline(always)]
pub fn rmsnorm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = weight.len();
    for xr in x.chunks_exact_mut(n) {
        let ss = dot(xr, xr) / n as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for (v, &g) in xr.iter_mut().zip(weight) {
            *v = g * (*v * inv);
        }
    }
}

/// Rotate-half RoPE on every `head_dim`-wide head of one token's row, with that position's
/// `cos`/`sin` tables (`head_dim / 2` entries each).
#[inline(always)]
pub fn rope_rotate_half(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        let (a, b) = head.split_at_mut(half);
        for i in 0..half {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

/// `gate = silu(gate) * up`, in place.
#[inline(always)]
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + exp(-*g)) * u;
    }
}

/// `e^x` from plain f32 operations (no libm call, no FMA), so a loop over it vectorizes and the
/// vector code gives the same bits as the scalar code: `x = n·ln2 + r` with `|r| ≤ ln2/2`
/// (Cody-Waite split of ln2), a degree-7 Taylor polynomial in `r` (truncation below 1e-8
/// relative), times `2^n` built from its exponent bits. Within a few ulp of the exact value on
/// `[-87, 88]`; inputs are clamped there (softmax only sees `x ≤ 0`, and SiLU's `1 + e^x` past
/// 88 is huge either way), so the result is always finite and positive.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln2 split so that n·LN2_HI is exact (LN2_HI = 355/512 has 9 significant bits).
    const LN2_HI: f32 = 355.0 / 512.0;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p * r + c;
    }
    // 2^n from n's bits: n + 127 is an integer in 1..=254 (x is clamped), so adding 1.5·2^23
    // puts it, exactly, in the low mantissa bits, and the shift moves it into the exponent. The
    // same bits as `(n as i32 + 127) << 23`, without the saturating float-to-int cast, which
    // compiles to scalar compares per lane and kept the softmax and SiLU loops from vectorizing.
    let biased = (n + (127.0 + 12_582_912.0)).to_bits();
    p * f32::from_bits(biased << 23)
}

/// Numerically stable softmax in place. The maximum and the sum use `LANES` partial results,
/// like [`dot`], so the whole function vectorizes.
#[inline(always)]
pub fn softmax(x: &mut [f32]) {
    let mut m = [f32::NEG_INFINITY; LANES];
    let (chunks, tail) = x.split_at(x.len() / LANES * LANES);
    for c in chunks.chunks_exact(LANES) {
        for l in 0..LANES {
            m[l] = m[l].max(c[l]);
        }
    }
    let max = tail.iter().chain(&m).copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        *v = exp(*v - max);
    }
    let mut acc = [0f32; LANES];
    let (chunks, tail) = x.split_at(x.len() / LANES * LANES);
    for c in chunks.chunks_exact(LANES) {
        for l in 0..LANES {
            acc[l] += c[l];
        }
    }
    let sum = reduce_lanes(acc) + tail.iter().sum::<f32>();
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// One row's mixture-of-experts choice: the softmax of its router `logits` (maximum
/// subtracted, `f32::exp`, summed in order), the `top_k` largest probabilities, largest first
/// and ties to the lower expert, divided by their sum when `normalize`.
pub fn moe_choice(logits: &[f32], top_k: usize, normalize: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|&v| (v - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    let mut order: Vec<(usize, f32)> = e.iter().map(|&v| v / sum).enumerate().collect();
    order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    order.truncate(top_k);
    if normalize {
        let total: f32 = order.iter().map(|c| c.1).sum();
        order.iter_mut().for_each(|c| c.1 /= total);
    }
    order
}

/// Shapes for [`attention`].
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Causal attention of `t` query rows at positions `pos0..pos0+t` over a KV cache holding
/// positions `0..pos0+t` (`k`/`v` rows of `num_kv_heads * head_dim`). GQA: query head `h` reads
/// KV head `h / (num_heads / num_kv_heads)`. `scores` needs `pos0 + t` entries.
pub fn attention(q: &[f32], k: &[f32], v: &[f32], pos0: usize, s: AttnShape, scores: &mut [f32], out: &mut [f32]) {
    attention_rows(q, k, v, pos0, s, scores, out, |p| p);
}

/// [`attention`] over K/V rows stored anywhere in `k`/`v`: position `p`'s row is `row(p)`
/// (a paged cache maps positions through its block table). Same arithmetic, same order.
#[allow(clippy::too_many_arguments)]
pub fn attention_rows(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos0: usize,
    s: AttnShape,
    scores: &mut [f32],
    out: &mut [f32],
    row: impl Fn(usize) -> usize,
) {
    let q_dim = s.num_heads * s.head_dim;
    let kv_dim = s.num_kv_heads * s.head_dim;
    let group = s.num_heads / s.num_kv_heads;
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    for (i, (qr, or)) in q.chunks_exact(q_dim).zip(out.chunks_exact_mut(q_dim)).enumerate() {
        let n = pos0 + i + 1;
        for h in 0..s.num_heads {
            let kvh = h / group;
            let qh = &qr[h * s.head_dim..(h + 1) * s.head_dim];
            let sc = &mut scores[..n];
            for (p, score) in sc.iter_mut().enumerate() {
                let kr = &k[row(p) * kv_dim + kvh * s.head_dim..][..s.head_dim];
                *score = dot(qh, kr) * scale;
            }
            softmax(sc);
            let oh = &mut or[h * s.head_dim..(h + 1) * s.head_dim];
            oh.fill(0.0);
            for (p, &w) in sc.iter().enumerate() {
                let vr = &v[row(p) * kv_dim + kvh * s.head_dim..][..s.head_dim];
                for (o, &x) in oh.iter_mut().zip(vr) {
                    *o += w * x;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive_dot(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
    }

    #[test]
    fn dot_matches_f64_sum() {
        for n in [1, 15, 16, 17, 100, 576] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.3).collect();
            assert!((dot(&a, &b) as f64 - naive_dot(&a, &b)).abs() < 1e-4, "n={n}");
        }
    }

    #[test]
    fn matmul_with_bias() {
        let x = [1.0, 2.0, 3.0, 4.0];
        let w = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let mut out = [0.0; 6];
        matmul_t(&x, &w, Some(&[0.5, 0.0, -1.0]), 2, &mut out);
        assert_eq!(out, [1.5, 2.0, 2.0, 3.5, 4.0, 6.0]);
    }

    #[test]
    fn softmax_sums_to_one_and_attention_of_one_position_is_v() {
        let mut x = [1.0, 2.0, 3.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let s = AttnShape {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 2,
        };
        let (q, k, v) = ([1.0, 0.0, 0.0, 1.0], [0.3, 0.7], [5.0, -2.0]);
        let mut scores = [0.0; 1];
        let mut out = [0.0; 4];
        attention(&q, &k, &v, 0, s, &mut scores, &mut out);
        assert_eq!(out, [5.0, -2.0, 5.0, -2.0]);
    }

    #[test]
    fn rope_rotates_pairs_of_halves() {
        let mut x = [1.0, 2.0, 3.0, 4.0];
        let (c, s) = ([0.0, 1.0], [1.0, 0.0]);
        rope_rotate_half(&mut x, 4, &c, &s);
        // Pair (x0, x2) is rotated by 90 degrees; pair (x1, x3) is unchanged.
        assert_eq!(x, [-3.0, 2.0, 1.0, 4.0]);
    }
}
