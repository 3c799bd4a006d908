//! Kernels of linear-attention layers (Qwen3-Next's and Qwen3.5's Gated DeltaNet): the causal
//! depthwise conv1d with its rolling state, the per-head L2 norm of queries and keys, the
//! gated delta rule's recurrence, and the sigmoid/SiLU gates around them (the gated RMSNorm
//! of each head's output, the gated attention's output gate, the shared expert's gate).
//!
//! Both the conv1d and the delta rule run token by token over a chunk, carrying per-sequence
//! state, so a prompt gives the same bits however it is cut into chunks or batched with
//! others (what the pipeline guarantees for attention layers too). The chunked form of the
//! delta rule (the UT transform, as transformers' `torch_chunk_gated_delta_rule` computes it)
//! is the same function summed in an order that depends on where each chunk starts, so it is
//! not used here; it is a candidate for a device that needs matrix products to be fast.
//!
//! As in [`super::elementwise`], the `reference` functions are plain element-wise f32 loops
//! (sums only along the state's rows, never across vector lanes), and each twin is the same
//! code compiled for AVX2 or AVX-512, which rounds identically: the tests check the bits.

use super::dispatch::{Kernels, dispatched};

/// The scalar definitions every twin compiles.
pub mod reference {
    use crate::kernels::cpu::reference as r;

    /// Causal depthwise conv1d over the `x.len() / channels` rows of `x`, then SiLU, into
    /// `out`. `weight_t` is `[kernel, channels]` (the checkpoint's `[channels, 1, kernel]`
    /// transposed, so each tap is one contiguous row); `state` holds the `kernel - 1` input
    /// rows before `x`'s first, oldest first (zeros for a new sequence), and is left holding
    /// those before the row after `x`'s last.
    #[inline(always)]
    pub fn conv1d_silu(
        x: &[f32],
        channels: usize,
        weight_t: &[f32],
        bias: Option<&[f32]>,
        state: &mut [f32],
        out: &mut [f32],
    ) {
        let kernel = weight_t.len() / channels;
        let hist = kernel - 1;
        let rows = x.len() / channels;
        for t in 0..rows {
            let o = &mut out[t * channels..(t + 1) * channels];
            match bias {
                Some(b) => o.copy_from_slice(b),
                None => o.fill(0.0),
            }
            for j in 0..kernel {
                // Row t + j of [state; x].
                let p = t + j;
                let input = match p < hist {
                    true => &state[p * channels..(p + 1) * channels],
                    false => &x[(p - hist) * channels..(p - hist + 1) * channels],
                };
                let w = &weight_t[j * channels..(j + 1) * channels];
                for ((o, &w), &v) in o.iter_mut().zip(w).zip(input) {
                    *o += w * v;
                }
            }
            for v in o.iter_mut() {
                *v = *v / (1.0 + r::exp(-*v));
            }
        }
        if hist == 0 || rows == 0 {
            return;
        }
        if rows >= hist {
            state.copy_from_slice(&x[(rows - hist) * channels..rows * channels]);
        } else {
            state.copy_within(rows * channels.., 0);
            state[(hist - rows) * channels..].copy_from_slice(x);
        }
    }

    /// Each `width`-wide piece of `x` times `scale / sqrt(sum of squares + eps)` (the L2 norm
    /// the gated delta rule applies to queries and keys; queries are also scaled by
    /// `1 / sqrt(width)`).
    #[inline(always)]
    pub fn l2norm_scaled(x: &mut [f32], width: usize, eps: f32, scale: f32) {
        for piece in x.chunks_exact_mut(width) {
            let inv = scale / (r::dot(piece, piece) + eps).sqrt();
            for v in piece.iter_mut() {
                *v *= inv;
            }
        }
    }

    /// `1 / (1 + e^-x)`.
    #[inline(always)]
    pub fn sigmoid(x: f32) -> f32 {
        1.0 / (1.0 + r::exp(-x))
    }

    /// `x *= sigmoid(gate)`, element by element.
    #[inline(always)]
    pub fn sigmoid_mul(x: &mut [f32], gate: &[f32]) {
        for (v, &g) in x.iter_mut().zip(gate) {
            *v *= sigmoid(g);
        }
    }

    /// `out[row] += sigmoid(gate[row]) · y[row]` for `width`-wide rows (one gate per row).
    #[inline(always)]
    pub fn add_sigmoid_scaled(out: &mut [f32], y: &[f32], gate: &[f32], width: usize) {
        for ((o, yr), &g) in out.chunks_exact_mut(width).zip(y.chunks_exact(width)).zip(gate) {
            let s = sigmoid(g);
            for (o, &v) in o.iter_mut().zip(yr) {
                *o += s * v;
            }
        }
    }

    /// RMSNorm of each `weight.len()`-wide piece of `x` in place, times `silu(z)` of the same
    /// values (Gated DeltaNet's output norm: normalize first, then gate).
    #[inline(always)]
    pub fn rmsnorm_gated(x: &mut [f32], weight: &[f32], eps: f32, z: &[f32]) {
        let n = weight.len();
        for (xr, zr) in x.chunks_exact_mut(n).zip(z.chunks_exact(n)) {
            let ss = r::dot(xr, xr) / n as f32;
            let inv = 1.0 / (ss + eps).sqrt();
            for ((v, &g), &z) in xr.iter_mut().zip(weight).zip(zr) {
                *v = g * (*v * inv) * (z * sigmoid(z));
            }
        }
    }

    /// One token of one head of the gated delta rule. `state` is `[dk, dv]` (row `i` for key
    /// dimension `i`): it decays by `decay` (`exp(g)`), then learns `v` at `k` at rate `beta`
    /// (the delta rule: only what the decayed state does not already predict is written), and
    /// the token reads the result at `q` into `out` (`dv`). `mem` is `dv` values of scratch.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub fn delta_step(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        decay: f32,
        beta: f32,
        state: &mut [f32],
        out: &mut [f32],
        mem: &mut [f32],
    ) {
        let dv = v.len();
        mem.fill(0.0);
        for (row, &ki) in state.chunks_exact_mut(dv).zip(k) {
            for (s, m) in row.iter_mut().zip(mem.iter_mut()) {
                *s *= decay;
                *m += *s * ki;
            }
        }
        for (m, &x) in mem.iter_mut().zip(v) {
            *m = (x - *m) * beta;
        }
        out.fill(0.0);
        for ((row, &ki), &qi) in state.chunks_exact_mut(dv).zip(k).zip(q) {
            for ((s, &d), o) in row.iter_mut().zip(mem.iter()).zip(out.iter_mut()) {
                *s += ki * d;
                *o += *s * qi;
            }
        }
    }
}

dispatched!(
    /// [`reference::conv1d_silu`] on path `k`.
    conv1d_silu(
        x: &[f32],
        channels: usize,
        weight_t: &[f32],
        bias: Option<&[f32]>,
        state: &mut [f32],
        out: &mut [f32]
    )
);
dispatched!(
    /// [`reference::sigmoid_mul`] on path `k`.
    sigmoid_mul(x: &mut [f32], gate: &[f32])
);
dispatched!(
    /// [`reference::add_sigmoid_scaled`] on path `k`.
    add_sigmoid_scaled(out: &mut [f32], y: &[f32], gate: &[f32], width: usize)
);
dispatched!(
    /// [`reference::rmsnorm_gated`] on path `k`.
    rmsnorm_gated(x: &mut [f32], weight: &[f32], eps: f32, z: &[f32])
);
dispatched!(
    /// [`reference::l2norm_scaled`] on path `k`.
    l2norm_scaled(x: &mut [f32], width: usize, eps: f32, scale: f32)
);
dispatched!(
    /// [`reference::delta_step`] on path `k`.
    delta_step(
        q: &[f32],
        k_: &[f32],
        v: &[f32],
        decay: f32,
        beta: f32,
        state: &mut [f32],
        out: &mut [f32],
        mem: &mut [f32]
    )
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::dispatch::KernelPath;
    use crate::kernels::cpu::paths_run::PathsRun;
    use crate::kernels::cpu::testdata::noise;

    /// A `delta_step` (q, k, v, decay, beta, state, out, scratch) on some path.
    type DeltaStep<'a> = dyn Fn(&[f32], &[f32], &[f32], f32, f32, &mut [f32], &mut [f32], &mut [f32]) + 'a;

    /// The conv1d in f64, straight from its definition over the whole sequence.
    fn conv_f64(x: &[f32], channels: usize, weight_t: &[f32], bias: &[f32]) -> Vec<f32> {
        let kernel = weight_t.len() / channels;
        let rows = x.len() / channels;
        let mut out = vec![0f32; x.len()];
        for t in 0..rows {
            for c in 0..channels {
                let mut acc = bias[c] as f64;
                for j in 0..kernel {
                    // Input at t - (kernel - 1 - j); zero before the sequence.
                    if let Some(p) = (t + j).checked_sub(kernel - 1) {
                        acc += weight_t[j * channels + c] as f64 * x[p * channels + c] as f64;
                    }
                }
                out[t * channels + c] = (acc / (1.0 + (-acc).exp())) as f32;
            }
        }
        out
    }

    #[test]
    fn conv1d_matches_its_definition_and_gives_the_same_bits_however_the_rows_are_chunked() {
        let mut paths = PathsRun::new(
            "kernels::cpu::linear_attention::tests::conv1d_matches_its_definition_and_gives_the_same_bits_however_the_rows_are_chunked",
        );
        for (channels, kernel) in [(40, 4), (17, 2), (64, 1), (33, 3)] {
            let rows = 11;
            let x = noise(rows * channels, 1, 2.0);
            let w = noise(kernel * channels, 2, 0.5);
            let b = noise(channels, 3, 0.1);
            let want = conv_f64(&x, channels, &w, &b);
            let hist = (kernel - 1) * channels;
            // All rows at once, on the reference.
            let mut whole = vec![0f32; x.len()];
            let mut state = vec![0f32; hist];
            reference::conv1d_silu(&x, channels, &w, Some(&b), &mut state, &mut whole);
            let err = whole.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 1e-5, "{channels}x{kernel}: off the definition by {err}");
            for k in Kernels::all_supported() {
                paths.record(k.path());
                // Chunks of 1, 2 and 5 rows, the state carried between them.
                for cut in [1, 2, 5] {
                    let mut state = vec![0f32; hist];
                    let mut got = vec![0f32; x.len()];
                    for (xs, os) in x.chunks(cut * channels).zip(got.chunks_mut(cut * channels)) {
                        conv1d_silu(k, xs, channels, &w, Some(&b), &mut state, os);
                    }
                    assert_eq!(got, whole, "{channels}x{kernel}, chunks of {cut}, {}", k.path());
                    // The state holds the last kernel - 1 inputs.
                    assert_eq!(state[..], x[x.len() - hist..], "{channels}x{kernel}");
                }
            }
        }
        paths.check(&KernelPath::ALL);
    }

    #[test]
    fn the_gates_match_their_definitions_and_give_the_same_bits_on_every_path() {
        let mut paths = PathsRun::new(
            "kernels::cpu::linear_attention::tests::the_gates_match_their_definitions_and_give_the_same_bits_on_every_path",
        );
        let sig = |x: f32| 1.0 / (1.0 + (-(x as f64)).exp());
        for (rows, width) in [(1, 8), (3, 17), (5, 64)] {
            let n = rows * width;
            let x = noise(n, 11, 3.0);
            let g = noise(n, 12, 6.0);
            let w = noise(width, 13, 1.0);
            let y = noise(n, 14, 1.0);
            let row_gate = noise(rows, 15, 4.0);
            let (mut a, mut b, mut c) = (x.clone(), x.clone(), x.clone());
            reference::sigmoid_mul(&mut a, &g);
            reference::add_sigmoid_scaled(&mut b, &y, &row_gate, width);
            reference::rmsnorm_gated(&mut c, &w, 1e-6, &g);
            for i in 0..n {
                let (r, col) = (i / width, i % width);
                let want = x[i] as f64 * sig(g[i]);
                assert!((a[i] as f64 - want).abs() < 1e-5, "sigmoid_mul");
                let want = x[i] as f64 + sig(row_gate[r]) * y[i] as f64;
                assert!((b[i] as f64 - want).abs() < 1e-5, "add_sigmoid_scaled");
                let row = &x[r * width..(r + 1) * width];
                let rms = (row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / width as f64 + 1e-6).sqrt();
                let want = w[col] as f64 * x[i] as f64 / rms * g[i] as f64 * sig(g[i]);
                assert!((c[i] as f64 - want).abs() < 1e-4, "rmsnorm_gated {} vs {want}", c[i]);
            }
            for k in Kernels::all_supported() {
                paths.record(k.path());
                let (mut a2, mut b2, mut c2) = (x.clone(), x.clone(), x.clone());
                sigmoid_mul(k, &mut a2, &g);
                add_sigmoid_scaled(k, &mut b2, &y, &row_gate, width);
                rmsnorm_gated(k, &mut c2, &w, 1e-6, &g);
                assert_eq!((&a2, &b2, &c2), (&a, &b, &c), "{} {rows}x{width}", k.path());
            }
        }
        paths.check(&KernelPath::ALL);
    }

    #[test]
    fn the_delta_rule_matches_its_definition_on_every_path() {
        let mut paths =
            PathsRun::new("kernels::cpu::linear_attention::tests::the_delta_rule_matches_its_definition_on_every_path");
        for (dk, dv) in [(16, 24), (32, 32), (8, 5)] {
            let tokens = 9;
            let mut q = noise(tokens * dk, 4, 1.0);
            let mut k = noise(tokens * dk, 5, 1.0);
            let v = noise(tokens * dv, 6, 1.0);
            let g: Vec<f32> = noise(tokens, 7, 1.0).iter().map(|x| -x.abs()).collect();
            let beta: Vec<f32> = noise(tokens, 8, 1.0).iter().map(|x| x.abs()).collect();
            let scale = 1.0 / (dk as f32).sqrt();
            reference::l2norm_scaled(&mut q, dk, 1e-6, scale);
            reference::l2norm_scaled(&mut k, dk, 1e-6, 1.0);
            // f64, the recurrence exactly as transformers writes it.
            let mut s = vec![0f64; dk * dv];
            let mut want = vec![0f32; tokens * dv];
            for t in 0..tokens {
                let decay = (g[t] as f64).exp();
                s.iter_mut().for_each(|x| *x *= decay);
                for j in 0..dv {
                    let mem: f64 = (0..dk).map(|i| s[i * dv + j] * k[t * dk + i] as f64).sum();
                    let delta = (v[t * dv + j] as f64 - mem) * beta[t] as f64;
                    for i in 0..dk {
                        s[i * dv + j] += k[t * dk + i] as f64 * delta;
                    }
                    want[t * dv + j] = (0..dk).map(|i| s[i * dv + j] * q[t * dk + i] as f64).sum::<f64>() as f32;
                }
            }
            let run = |step: &DeltaStep<'_>| {
                let (mut state, mut mem, mut out) = (vec![0f32; dk * dv], vec![0f32; dv], vec![0f32; tokens * dv]);
                for t in 0..tokens {
                    let decay = crate::kernels::cpu::reference::exp(g[t]);
                    step(
                        &q[t * dk..(t + 1) * dk],
                        &k[t * dk..(t + 1) * dk],
                        &v[t * dv..(t + 1) * dv],
                        decay,
                        beta[t],
                        &mut state,
                        &mut out[t * dv..(t + 1) * dv],
                        &mut mem,
                    );
                }
                out
            };
            let reference_out = run(&reference::delta_step);
            let err = reference_out
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 1e-5, "{dk}x{dv}: off the definition by {err}");
            for kern in Kernels::all_supported() {
                paths.record(kern.path());
                let got = run(&|q, k, v, d, b, s, o, m| delta_step(kern, q, k, v, d, b, s, o, m));
                assert_eq!(got, reference_out, "{dk}x{dv}, {}", kern.path());
                let mut x = q.clone();
                let mut y = q.clone();
                reference::l2norm_scaled(&mut x, dk, 1e-6, 0.5);
                l2norm_scaled(kern, &mut y, dk, 1e-6, 0.5);
                assert_eq!(x, y, "l2norm {}", kern.path());
            }
        }
        paths.check(&KernelPath::ALL);
    }
}
