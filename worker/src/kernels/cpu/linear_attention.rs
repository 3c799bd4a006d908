//! Kernels of linear-attention layers (Qwen3-Next's and Qwen3.5's Gated DeltaNet): the causal
//! depthwise conv1d with its rolling state, the per-head L2 norm of queries and keys, the
//! gated delta rule's recurrence, and the sigmoid/SiLU gates around them (the gated RMSNorm
//! of each head's output, the gated attention's output gate, the shared expert's gate).
//!
//! The conv1d runs token by token over a chunk, carrying per-sequence state. The delta rule
//! runs either token by token ([`delta_step`], decode and the odd positions of a prompt) or
//! over a window of consecutive tokens at once ([`delta_chunk`], the chunked form: products
//! with the state at the window's start, so the state is read twice a window instead of twice
//! a token). The two are the same function summed in different orders, so which one a
//! position gets must not depend on scheduling: the stage runs the chunked form only over
//! whole windows aligned to position 0 inside a sequence's prompt
//! ([`baton_shared::model_config::DELTA_RULE_WINDOW`]), and the coordinator ends a hybrid
//! prompt's chunks on those boundaries. Then a prompt gives the same bits however it is cut
//! into chunks, batched with others, preempted or restored from a prefix snapshot.
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

    /// Columns of the state [`delta_chunk`] carries in registers at once.
    const COLUMNS: usize = 16;
    /// Rows [`delta_chunk`] carries at once over a strip of columns (enough independent sums
    /// to keep the adders busy despite their latency).
    const ROWS: usize = 4;

    /// Floats of scratch [`delta_chunk`] needs for `rows` tokens with `dv`-wide values.
    pub const fn delta_chunk_scratch(rows: usize, dv: usize) -> usize {
        2 * rows * dv + 2 * rows * rows + (2 + ROWS) * rows
    }

    /// `Σ_i xs[r][i] · state[i][c0..c0 + COLUMNS]` for each of the `R` rows `xs`, each sum in
    /// order of `i` (what a one-row loop computes, so the bits do not depend on `R`).
    #[inline(always)]
    fn rows_times_state<const R: usize>(xs: [&[f32]; R], state: &[f32], dv: usize, c0: usize) -> [[f32; COLUMNS]; R] {
        let dk = xs[0].len();
        let xs: [&[f32]; R] = std::array::from_fn(|r| &xs[r][..dk]);
        assert!(c0 + COLUMNS <= dv && state.len() >= dk * dv);
        let mut acc = [[0f32; COLUMNS]; R];
        for i in 0..dk {
            let s = &state[i * dv + c0..i * dv + c0 + COLUMNS];
            for r in 0..R {
                let x = xs[r][i];
                for l in 0..COLUMNS {
                    acc[r][l] += x * s[l];
                }
            }
        }
        acc
    }

    /// State rows `rows` (`R` rows of `dv`) at columns `c0..c0 + COLUMNS` become
    /// `el · row + Σ_j coefs[r][j] · delta[j]`, each sum in order of `j`.
    #[inline(always)]
    fn update_state_rows<const R: usize>(
        rows: &mut [f32],
        coefs: [&[f32]; R],
        delta: &[f32],
        el: f32,
        dv: usize,
        c0: usize,
    ) {
        let n = coefs[0].len();
        let coefs: [&[f32]; R] = std::array::from_fn(|r| &coefs[r][..n]);
        assert!(c0 + COLUMNS <= dv && delta.len() >= n * dv && rows.len() >= R * dv);
        let mut acc = [[0f32; COLUMNS]; R];
        for r in 0..R {
            for l in 0..COLUMNS {
                acc[r][l] = el * rows[r * dv + c0 + l];
            }
        }
        for j in 0..n {
            let d = &delta[j * dv + c0..j * dv + c0 + COLUMNS];
            for r in 0..R {
                let c = coefs[r][j];
                for l in 0..COLUMNS {
                    acc[r][l] += c * d[l];
                }
            }
        }
        for r in 0..R {
            rows[r * dv + c0..r * dv + c0 + COLUMNS].copy_from_slice(&acc[r]);
        }
    }

    /// `rows` consecutive tokens of one head of the gated delta rule at once: what `rows` calls
    /// of [`delta_step`] compute, in the chunked form. With `G_t` the running sum of the log
    /// decays and `S` the state before the first token, token t learns
    /// `δ_t = β_t (v_t - e^{G_t} Sᵀk_t - Σ_{j<t} e^{G_t-G_j} (k_t·k_j) δ_j)`, reads
    /// `o_t = e^{G_t} Sᵀq_t + Σ_{j≤t} e^{G_t-G_j} (q_t·k_j) δ_j`, and the state becomes
    /// `e^{G_last} S + Σ_j e^{G_last-G_j} k_j ⊗ δ_j`. `q` and `k` are `rows × dk`, `v` and `out`
    /// `rows × dv`, `log_decay` the log of each token's decay (≤ 0, so no exponent here
    /// exceeds 1), `scratch` [`delta_chunk_scratch`] floats.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub fn delta_chunk(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        log_decay: &[f32],
        beta: &[f32],
        state: &mut [f32],
        out: &mut [f32],
        scratch: &mut [f32],
    ) {
        let n = beta.len();
        if n == 0 {
            return;
        }
        let (dk, dv) = (q.len() / n, v.len() / n);
        let (ks, rest) = scratch.split_at_mut(n * dv);
        let (delta, rest) = rest.split_at_mut(n * dv);
        let (kk, rest) = rest.split_at_mut(n * n);
        let (qk, rest) = rest.split_at_mut(n * n);
        let (cum, rest) = rest.split_at_mut(n);
        let (tail, coef) = rest.split_at_mut(n);
        let mut g = 0f32;
        for (c, &x) in cum.iter_mut().zip(log_decay) {
            g += x;
            *c = g;
        }
        // Sᵀk_t into ks and Sᵀq_t into out, a strip of columns at a time so the strip stays
        // in L1 for every token; each value sums over the key dimension in order.
        let full = dv / COLUMNS * COLUMNS;
        for c0 in (0..full).step_by(COLUMNS) {
            let (kr, qr) = (|t: usize| &k[t * dk..(t + 1) * dk], |t: usize| &q[t * dk..(t + 1) * dk]);
            let mut store = |t: usize, ak: [f32; COLUMNS], aq: [f32; COLUMNS]| {
                ks[t * dv + c0..t * dv + c0 + COLUMNS].copy_from_slice(&ak);
                out[t * dv + c0..t * dv + c0 + COLUMNS].copy_from_slice(&aq);
            };
            // Two tokens (four rows) at a time, then the odd one.
            let mut t = 0;
            while t + 1 < n {
                let [ak0, aq0, ak1, aq1] = rows_times_state([kr(t), qr(t), kr(t + 1), qr(t + 1)], state, dv, c0);
                store(t, ak0, aq0);
                store(t + 1, ak1, aq1);
                t += 2;
            }
            if t < n {
                let [ak, aq] = rows_times_state([kr(t), qr(t)], state, dv, c0);
                store(t, ak, aq);
            }
        }
        for c in full..dv {
            for t in 0..n {
                let (mut ak, mut aq) = (0f32, 0f32);
                for i in 0..dk {
                    ak += k[t * dk + i] * state[i * dv + c];
                    aq += q[t * dk + i] * state[i * dv + c];
                }
                ks[t * dv + c] = ak;
                out[t * dv + c] = aq;
            }
        }
        for t in 0..n {
            let (qt, kt) = (&q[t * dk..(t + 1) * dk], &k[t * dk..(t + 1) * dk]);
            for j in 0..=t {
                let kj = &k[j * dk..(j + 1) * dk];
                kk[t * n + j] = r::dot(kt, kj);
                qk[t * n + j] = r::dot(qt, kj);
            }
        }
        // The δ rows in order: each subtracts what the earlier ones already taught the state.
        for t in 0..n {
            let (et, b) = (r::exp(cum[t]), beta[t]);
            let (done, rest) = delta.split_at_mut(t * dv);
            let d = &mut rest[..dv];
            for ((d, &x), &s) in d
                .iter_mut()
                .zip(&v[t * dv..(t + 1) * dv])
                .zip(&ks[t * dv..(t + 1) * dv])
            {
                *d = b * (x - et * s);
            }
            for j in 0..t {
                let w = b * r::exp(cum[t] - cum[j]) * kk[t * n + j];
                for (d, &e) in d.iter_mut().zip(&done[j * dv..(j + 1) * dv]) {
                    *d -= w * e;
                }
            }
            let o = &mut out[t * dv..(t + 1) * dv];
            o.iter_mut().for_each(|o| *o *= et);
            for j in 0..t {
                let w = r::exp(cum[t] - cum[j]) * qk[t * n + j];
                for (o, &e) in o.iter_mut().zip(&done[j * dv..(j + 1) * dv]) {
                    *o += w * e;
                }
            }
            let w = qk[t * n + t];
            for (o, &e) in o.iter_mut().zip(d.iter()) {
                *o += w * e;
            }
        }
        // The state after the last token, row by row.
        let last = cum[n - 1];
        for (w, &c) in tail.iter_mut().zip(cum.iter()) {
            *w = r::exp(last - c);
        }
        let el = r::exp(last);
        let mut i = 0;
        while i < dk {
            let m = ROWS.min(dk - i);
            for r in 0..m {
                for (c, (&w, kj)) in coef[r * n..(r + 1) * n]
                    .iter_mut()
                    .zip(tail.iter().zip(k.chunks_exact(dk)))
                {
                    *c = w * kj[i + r];
                }
            }
            let rows = &mut state[i * dv..(i + m) * dv];
            for c0 in (0..full).step_by(COLUMNS) {
                match m {
                    ROWS => {
                        let cs = [&coef[..n], &coef[n..2 * n], &coef[2 * n..3 * n], &coef[3 * n..4 * n]];
                        update_state_rows(rows, cs, delta, el, dv, c0);
                    }
                    _ => {
                        for r in 0..m {
                            let row = &mut rows[r * dv..(r + 1) * dv];
                            update_state_rows(row, [&coef[r * n..(r + 1) * n]], delta, el, dv, c0);
                        }
                    }
                }
            }
            for r in 0..m {
                for col in full..dv {
                    let mut acc = el * rows[r * dv + col];
                    for (j, &c) in coef[r * n..(r + 1) * n].iter().enumerate() {
                        acc += c * delta[j * dv + col];
                    }
                    rows[r * dv + col] = acc;
                }
            }
            i += m;
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

dispatched!(
    /// [`reference::delta_chunk`] on path `k`.
    delta_chunk(
        q: &[f32],
        k_: &[f32],
        v: &[f32],
        log_decay: &[f32],
        beta: &[f32],
        state: &mut [f32],
        out: &mut [f32],
        scratch: &mut [f32]
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

    #[test]
    fn the_chunked_delta_rule_computes_what_the_steps_do_with_the_same_bits_on_every_path() {
        let mut paths = PathsRun::new(
            "kernels::cpu::linear_attention::tests::the_chunked_delta_rule_computes_what_the_steps_do_with_the_same_bits_on_every_path",
        );
        // Widths with and without a column tail, windows of one token to past the stage's 16,
        // and decays from none to strong enough that e^G underflows within the window.
        for (dk, dv) in [(16, 24), (32, 32), (8, 5), (128, 128)] {
            for (rows, strength) in [(1, 1.0), (5, 0.5), (16, 1.0), (16, 40.0), (23, 0.1)] {
                let seed = (dk * 31 + dv * 7 + rows) as u64;
                let mut q = noise(rows * dk, seed, 1.0);
                let mut k = noise(rows * dk, seed + 1, 1.0);
                let v = noise(rows * dv, seed + 2, 1.0);
                let log_decay: Vec<f32> = noise(rows, seed + 3, strength).iter().map(|x| -x.abs()).collect();
                let beta: Vec<f32> = noise(rows, seed + 4, 1.0).iter().map(|x| x.abs().min(1.0)).collect();
                reference::l2norm_scaled(&mut q, dk, 1e-6, 1.0 / (dk as f32).sqrt());
                reference::l2norm_scaled(&mut k, dk, 1e-6, 1.0);
                let state0 = noise(dk * dv, seed + 5, 0.5);
                // Token by token.
                let (mut want_state, mut mem, mut want) = (state0.clone(), vec![0f32; dv], vec![0f32; rows * dv]);
                for t in 0..rows {
                    let decay = crate::kernels::cpu::reference::exp(log_decay[t]);
                    reference::delta_step(
                        &q[t * dk..(t + 1) * dk],
                        &k[t * dk..(t + 1) * dk],
                        &v[t * dv..(t + 1) * dv],
                        decay,
                        beta[t],
                        &mut want_state,
                        &mut want[t * dv..(t + 1) * dv],
                        &mut mem,
                    );
                }
                let mut scratch = vec![f32::NAN; reference::delta_chunk_scratch(rows, dv)];
                let (mut state, mut got) = (state0.clone(), vec![f32::NAN; rows * dv]);
                reference::delta_chunk(&q, &k, &v, &log_decay, &beta, &mut state, &mut got, &mut scratch);
                let off = |a: &[f32], b: &[f32]| {
                    a.iter()
                        .zip(b)
                        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
                        .fold(0f32, f32::max)
                };
                let case = format!("{dk}x{dv}, {rows} rows, decay strength {strength}");
                assert!(off(&got, &want) < 2e-5, "{case}: outputs off by {}", off(&got, &want));
                assert!(
                    off(&state, &want_state) < 2e-5,
                    "{case}: state off by {}",
                    off(&state, &want_state)
                );
                for kern in Kernels::all_supported() {
                    paths.record(kern.path());
                    let (mut s2, mut o2) = (state0.clone(), vec![0f32; rows * dv]);
                    delta_chunk(kern, &q, &k, &v, &log_decay, &beta, &mut s2, &mut o2, &mut scratch);
                    assert_eq!((&o2, &s2), (&got, &state), "{case}, {}", kern.path());
                }
            }
        }
        paths.check(&KernelPath::ALL);
    }
}
