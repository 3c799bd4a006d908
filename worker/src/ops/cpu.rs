//! [`Ops`] on the CPU: the runtime-dispatched SIMD kernels on a thread pool sized to the socket.
//! Everything CPU-specific (the kernel path, the thread count, quantized activations) lives
//! here and in [`crate::kernels::cpu`]; model code never names it.

use std::sync::Arc;

use super::{AttnMask, AttnShape, HostMatrix, LinearAttnShape, Ops, OpsInfo, Product};
use crate::kernels::cpu::attention::{SeqAttn, attention_batch};
use crate::kernels::cpu::dispatch::Kernels;
use crate::kernels::cpu::elementwise as ew;
use crate::kernels::cpu::linear_attention as la;
use crate::kernels::cpu::matmul::{self, Matrix, WeightFormat};
use crate::kernels::cpu::moe::{self, Routing};
use crate::kernels::cpu::q8::QuantizedRows;
use crate::kv_cache::{BatchKv, delta_windows};
use crate::model::ForwardError;
use crate::threads::{SharedMut, ThreadPool};

/// CPU-specific choices, owned by the CPU operations rather than by the backend options every
/// device shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuOptions {
    /// Threads for the matrix products (the calling thread included) when the device does not
    /// say (`cpu` rather than `cpu:N`).
    pub threads: usize,
    /// Kernel path; `None` picks the fastest this CPU supports.
    pub kernels: Option<Kernels>,
}

impl CpuOptions {
    /// `threads` threads on the fastest kernel path.
    pub fn threads(threads: usize) -> Self {
        Self { threads, kernels: None }
    }
}

/// The CPU as a device.
#[derive(Debug, Clone)]
pub struct CpuOps {
    kernels: Kernels,
    pool: Arc<ThreadPool>,
}

/// Rows of f32 in host memory. It keeps its largest allocation: a smaller batch after a larger
/// one neither frees nor refills memory, so steady serving allocates nothing.
#[derive(Debug, Default, Clone)]
pub struct CpuBuf {
    data: Vec<f32>,
    len: usize,
}

impl std::ops::Deref for CpuBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.data[..self.len]
    }
}

impl std::ops::DerefMut for CpuBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.data[..self.len]
    }
}

/// Work memory kept between calls.
#[derive(Debug, Default)]
pub struct CpuWorkspace {
    /// Activations quantized for Q8_0/Q4 weights.
    xq: QuantizedRows,
    /// Attention scores, one buffer per (sequence, head) task.
    scores: Vec<f32>,
    /// First row of each sequence of a batch.
    offsets: Vec<usize>,
    /// Gated DeltaNet: the conv's output rows, each row's `beta` and log decay per value head,
    /// each head's delta-rule scratch, and each head's window of the chunked form.
    conv_out: Vec<f32>,
    beta: Vec<f32>,
    log_decay: Vec<f32>,
    mem: Vec<f32>,
    windows: Vec<f32>,
}

/// One value head's gather of a delta-rule window, laid out in [`CpuWorkspace::windows`].
struct DeltaWindow<'w> {
    q: &'w mut [f32],
    k: &'w mut [f32],
    v: &'w mut [f32],
    log_decay: &'w mut [f32],
    beta: &'w mut [f32],
    out: &'w mut [f32],
    scratch: &'w mut [f32],
}

impl<'w> DeltaWindow<'w> {
    /// Floats one head's window takes for `rows` tokens of the given widths.
    fn floats(rows: usize, dk: usize, dv: usize) -> usize {
        rows * (2 * dk + 2 * dv + 2) + la::reference::delta_chunk_scratch(rows, dv)
    }

    /// Split one head's share of the workspace.
    fn split(buf: &'w mut [f32], rows: usize, dk: usize, dv: usize) -> Self {
        let (q, rest) = buf.split_at_mut(rows * dk);
        let (k, rest) = rest.split_at_mut(rows * dk);
        let (v, rest) = rest.split_at_mut(rows * dv);
        let (log_decay, rest) = rest.split_at_mut(rows);
        let (beta, rest) = rest.split_at_mut(rows);
        let (out, scratch) = rest.split_at_mut(rows * dv);
        Self {
            q,
            k,
            v,
            log_decay,
            beta,
            out,
            scratch,
        }
    }
}

impl CpuOps {
    /// Operations on `threads` threads (at least one) on the kernel path `kernels` (the
    /// fastest this CPU supports when `None`).
    pub fn new(threads: usize, kernels: Option<Kernels>) -> Self {
        Self {
            kernels: kernels.unwrap_or_else(Kernels::detect),
            pool: Arc::new(ThreadPool::new(threads.max(1))),
        }
    }

    /// Operations on an existing pool (benchmarks share one pool between several models).
    pub fn with_pool(kernels: Kernels, pool: Arc<ThreadPool>) -> Self {
        Self { kernels, pool }
    }

    /// The reference configuration: one thread on the fastest path (bit-identical to the
    /// scalar reference kernels, which the tests check).
    pub fn reference() -> Self {
        Self::new(1, None)
    }

    /// The kernel path.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }
}

impl Ops for CpuOps {
    type Buf = CpuBuf;
    type Mat = Matrix;
    type Vector = Vec<f32>;
    type Kv<'a> = dyn BatchKv + 'a;
    type Workspace = CpuWorkspace;
    type Routing = Routing;
    /// Never made: the CPU runs experts one by one.
    type Experts = std::convert::Infallible;

    fn info(&self) -> OpsInfo {
        OpsInfo {
            kernels: self.kernels.path().name().to_string(),
            threads: self.pool.threads(),
        }
    }

    fn matrix(&self, m: HostMatrix, format: WeightFormat) -> Result<Matrix, String> {
        match m {
            HostMatrix::F32 { values, cols } => Ok(Matrix::from_f32(values, cols, format)),
            HostMatrix::Blocks {
                dtype,
                bytes,
                rows,
                cols,
            } => Matrix::from_ggml(dtype, &bytes, rows, cols)
                .unwrap_or_else(|| Err(format!("{dtype} is not a block format"))),
        }
    }

    fn vector(&self, v: Vec<f32>) -> Vec<f32> {
        v
    }

    fn matrix_bytes(&self, m: &Matrix) -> usize {
        m.bytes()
    }

    fn vector_len(&self, v: &Vec<f32>) -> usize {
        v.len()
    }

    fn resize(&self, buf: &mut CpuBuf, len: usize) {
        if buf.data.len() < len {
            buf.data.resize(len, 0.0);
        }
        buf.len = len;
    }

    fn len(&self, buf: &CpuBuf) -> usize {
        buf.len
    }

    fn upload(&self, host: &[f32], buf: &mut CpuBuf) {
        self.resize(buf, host.len());
        buf.copy_from_slice(host);
    }

    fn download(&self, buf: &CpuBuf, host: &mut [f32]) {
        host.copy_from_slice(buf);
    }

    fn embed(&self, table: &Matrix, tokens: &[u32], out: &mut CpuBuf) -> Result<(), ForwardError> {
        self.resize(out, tokens.len() * table.view().cols());
        embed_rows(table, tokens, out)
    }

    fn matmul(&self, ws: &mut CpuWorkspace, x: &CpuBuf, w: &Matrix, bias: Option<&Vec<f32>>, out: &mut CpuBuf) {
        self.matmul_many(ws, x, [(w, bias, out)]);
    }

    fn matmul_many<const N: usize>(&self, ws: &mut CpuWorkspace, x: &CpuBuf, products: [Product<'_, Self>; N]) {
        let Some(cols) = products.first().map(|p| p.0.view().cols()) else {
            return;
        };
        let t = x.len() / cols;
        let products = products.map(|(w, bias, out)| {
            let w = w.view();
            self.resize(out, t * w.rows());
            (w, bias.map(Vec::as_slice), &mut **out)
        });
        matmul::matmul_many(self.kernels, &self.pool, x, products, &mut ws.xq);
    }

    fn rmsnorm(&self, x: &CpuBuf, w: &Vec<f32>, eps: f32, out: &mut CpuBuf) {
        self.resize(out, x.len());
        ew::rmsnorm(self.kernels, x, w, eps, out);
    }

    fn rmsnorm_inplace(&self, x: &mut CpuBuf, w: &Vec<f32>, eps: f32) {
        ew::rmsnorm_inplace(self.kernels, x, w, eps);
    }

    fn rope(&self, x: &mut CpuBuf, width: usize, head_dim: usize, rotary_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = rotary_dim / 2;
        for (i, row) in x.chunks_exact_mut(width).enumerate() {
            let at = i * half..(i + 1) * half;
            if rotary_dim == head_dim {
                ew::rope_rotate_half(self.kernels, row, head_dim, &cos[at.clone()], &sin[at]);
            } else {
                for head in row.chunks_exact_mut(head_dim) {
                    let (c, s) = (&cos[at.clone()], &sin[at.clone()]);
                    ew::rope_rotate_half(self.kernels, &mut head[..rotary_dim], rotary_dim, c, s);
                }
            }
        }
    }

    fn deinterleave(&self, x: &CpuBuf, piece: usize, a: &mut CpuBuf, b: &mut CpuBuf) {
        let half = x.len() / 2;
        self.resize(a, half);
        self.resize(b, half);
        for ((src, a), b) in x
            .chunks_exact(2 * piece)
            .zip(a.chunks_exact_mut(piece))
            .zip(b.chunks_exact_mut(piece))
        {
            a.copy_from_slice(&src[..piece]);
            b.copy_from_slice(&src[piece..]);
        }
    }

    fn sigmoid_mul(&self, x: &mut CpuBuf, gate: &CpuBuf) {
        la::sigmoid_mul(self.kernels, x, gate);
    }

    fn add_sigmoid_scaled(&self, out: &mut CpuBuf, y: &CpuBuf, gate: &CpuBuf) {
        let width = out.len() / gate.len().max(1);
        la::add_sigmoid_scaled(self.kernels, out, y, gate, width);
    }

    fn rmsnorm_gated(&self, x: &mut CpuBuf, w: &Vec<f32>, eps: f32, z: &CpuBuf) {
        la::rmsnorm_gated(self.kernels, x, w, eps, z);
    }

    fn split_qkvz(
        &self,
        qkvz: &CpuBuf,
        ba: &CpuBuf,
        shape: LinearAttnShape,
        qkv: &mut CpuBuf,
        z: &mut CpuBuf,
        b: &mut CpuBuf,
        a: &mut CpuBuf,
    ) {
        let (nk, nv, dk, dv) = (
            shape.key_heads,
            shape.value_heads,
            shape.key_head_dim,
            shape.value_head_dim,
        );
        let per_k = nv / nk;
        let (keys, values, channels) = (shape.keys(), shape.values(), shape.channels());
        let group = 2 * dk + 2 * per_k * dv;
        let rows = qkvz.len() / (group * nk).max(1);
        self.resize(qkv, rows * channels);
        self.resize(z, rows * values);
        self.resize(b, rows * nv);
        self.resize(a, rows * nv);
        let vw = per_k * dv;
        for t in 0..rows {
            let src = &qkvz[t * group * nk..(t + 1) * group * nk];
            let dst = &mut qkv[t * channels..(t + 1) * channels];
            let zt = &mut z[t * values..(t + 1) * values];
            let bat = &ba[t * 2 * nv..(t + 1) * 2 * nv];
            for g in 0..nk {
                let s = &src[g * group..(g + 1) * group];
                dst[g * dk..(g + 1) * dk].copy_from_slice(&s[..dk]);
                dst[keys + g * dk..keys + (g + 1) * dk].copy_from_slice(&s[dk..2 * dk]);
                dst[2 * keys + g * vw..2 * keys + (g + 1) * vw].copy_from_slice(&s[2 * dk..2 * dk + vw]);
                zt[g * vw..(g + 1) * vw].copy_from_slice(&s[2 * dk + vw..]);
                let heads = g * per_k..(g + 1) * per_k;
                b[t * nv + heads.start..t * nv + heads.end].copy_from_slice(&bat[g * 2 * per_k..g * 2 * per_k + per_k]);
                a[t * nv + heads.start..t * nv + heads.end]
                    .copy_from_slice(&bat[g * 2 * per_k + per_k..(g + 1) * 2 * per_k]);
            }
        }
    }

    fn linear_attention(
        &self,
        ws: &mut CpuWorkspace,
        layer: usize,
        qkv: &CpuBuf,
        b: &CpuBuf,
        a: &CpuBuf,
        params: [&Vec<f32>; 3],
        shape: LinearAttnShape,
        kv: &mut (dyn BatchKv + '_),
        out: &mut CpuBuf,
    ) {
        let [conv_t, dt_bias, a_rate] = params;
        let (nv, dk, dv) = (shape.value_heads, shape.key_head_dim, shape.value_head_dim);
        let (keys, values, channels) = (shape.keys(), shape.values(), shape.channels());
        let rows = kv_rows(kv);
        self.resize(out, rows * values);
        ws.conv_out.resize(rows * channels, 0.0);
        ws.beta.resize(rows * nv, 0.0);
        ws.log_decay.resize(rows * nv, 0.0);
        ws.mem.resize(nv * dv, 0.0);
        const WINDOW: usize = baton_shared::model_config::DELTA_RULE_WINDOW;
        let per_head = DeltaWindow::floats(WINDOW, dk, dv);
        ws.windows.resize(nv * per_head, 0.0);
        for t in 0..rows {
            for h in 0..nv {
                let i = t * nv + h;
                ws.beta[i] = la::reference::sigmoid(b[i]);
                ws.log_decay[i] = a_rate[h] * softplus(a[i] + dt_bias[h]);
            }
        }
        let conv_state = shape.conv_state();
        let q_scale = 1.0 / (dk as f32).sqrt();
        let mut row = 0;
        for i in 0..kv.seqs() {
            let (pos0, n) = kv.span(i);
            // Rows (from the sequence's first) that take the chunked form, whole windows.
            let windows = delta_windows(pos0, n, kv.prompt_len(i));
            let windows = row + windows.start - pos0..row + windows.end - pos0;
            let state = kv.state(i, layer);
            let (cs, rec) = state.split_at_mut(conv_state);
            let span = row * channels..(row + n) * channels;
            la::conv1d_silu(
                self.kernels,
                &qkv[span.clone()],
                channels,
                conv_t,
                None,
                cs,
                &mut ws.conv_out[span],
            );
            for t in row..row + n {
                let c = &mut ws.conv_out[t * channels..(t + 1) * channels];
                let (qk, _) = c.split_at_mut(2 * keys);
                let (q, k) = qk.split_at_mut(keys);
                la::l2norm_scaled(self.kernels, q, dk, 1e-6, q_scale);
                la::l2norm_scaled(self.kernels, k, dk, 1e-6, 1.0);
            }
            // Each value head's recurrence is its own (its state, its output columns), so the
            // heads run on the pool's threads, each over all of the sequence's rows in order:
            // the same arithmetic whatever the thread count.
            let (conv_out, log_decay, beta) = (&ws.conv_out, &ws.log_decay, &ws.beta);
            let (rec, outs, mems) = (SharedMut::new(rec), SharedMut::new(out), SharedMut::new(&mut ws.mem));
            let wins = SharedMut::new(&mut ws.windows);
            let head = |h: usize| {
                let g = shape.key_head(h);
                // SAFETY: head h alone touches its state block, its scratch and its columns.
                let (state, mem) = unsafe { (rec.slice(h * dk * dv, dk * dv), mems.slice(h * dv, dv)) };
                // SAFETY: as above.
                let w = DeltaWindow::split(unsafe { wins.slice(h * per_head, per_head) }, WINDOW, dk, dv);
                let qkv_of = |t: usize| {
                    let c = &conv_out[t * channels..(t + 1) * channels];
                    let v = &c[2 * keys..];
                    (
                        &c[g * dk..(g + 1) * dk],
                        &c[keys + g * dk..keys + (g + 1) * dk],
                        &v[h * dv..(h + 1) * dv],
                    )
                };
                let step = |t: usize, state: &mut [f32], mem: &mut [f32]| {
                    let (q, k, v) = qkv_of(t);
                    // SAFETY: as above.
                    let o = unsafe { outs.slice(t * values + h * dv, dv) };
                    let (d, b) = (log_decay[t * nv + h].exp(), beta[t * nv + h]);
                    la::delta_step(self.kernels, q, k, v, d, b, state, o, mem);
                };
                (row..windows.start).for_each(|t| step(t, state, mem));
                for t in windows.clone().step_by(WINDOW) {
                    for j in 0..WINDOW {
                        let (q, k, v) = qkv_of(t + j);
                        w.q[j * dk..(j + 1) * dk].copy_from_slice(q);
                        w.k[j * dk..(j + 1) * dk].copy_from_slice(k);
                        w.v[j * dv..(j + 1) * dv].copy_from_slice(v);
                        w.log_decay[j] = log_decay[(t + j) * nv + h];
                        w.beta[j] = beta[(t + j) * nv + h];
                    }
                    la::delta_chunk(
                        self.kernels,
                        w.q,
                        w.k,
                        w.v,
                        w.log_decay,
                        w.beta,
                        state,
                        w.out,
                        w.scratch,
                    );
                    for j in 0..WINDOW {
                        // SAFETY: as above.
                        let o = unsafe { outs.slice((t + j) * values + h * dv, dv) };
                        o.copy_from_slice(&w.out[j * dv..(j + 1) * dv]);
                    }
                }
                (windows.end..row + n).for_each(|t| step(t, state, mem));
            };
            // A head's step is about 4·dk·dv flops: below ~64k flops a task, dispatch costs more.
            if self.pool.threads() == 1 || nv < 2 || n * dk * dv < 16 * 1024 {
                (0..nv).for_each(head);
            } else {
                self.pool.run(nv, &head);
            }
            row += n;
        }
    }

    fn silu_mul(&self, gate: &mut CpuBuf, up: &CpuBuf, width: usize) {
        // Element-wise, so spreading rows over the pool never changes a result.
        const ROWS: usize = 8;
        let rows = gate.len() / width;
        if rows < 2 * ROWS || self.pool.threads() == 1 {
            return ew::silu_mul(self.kernels, gate, up);
        }
        let shared = SharedMut::new(gate);
        self.pool.run(rows.div_ceil(ROWS), &|task| {
            let (v0, n) = (task * ROWS * width, ROWS.min(rows - task * ROWS) * width);
            // SAFETY: tasks cover disjoint row ranges.
            let g = unsafe { shared.slice(v0, n) };
            ew::silu_mul(self.kernels, g, &up[v0..v0 + n]);
        });
    }

    fn add(&self, x: &mut CpuBuf, y: &CpuBuf) {
        x.iter_mut().zip(y.iter()).for_each(|(x, y)| *x += y);
    }

    fn zeros(&self, buf: &mut CpuBuf, len: usize) {
        self.resize(buf, len);
        buf.fill(0.0);
    }

    fn experts(&self, _experts: &[[&Matrix; 3]]) -> Option<Self::Experts> {
        None
    }

    fn routed_experts(
        &self,
        _ws: &mut CpuWorkspace,
        _x: &CpuBuf,
        _routing: &Routing,
        experts: &Self::Experts,
        _scratch: [&mut CpuBuf; 3],
        _out: &mut CpuBuf,
    ) -> Option<usize> {
        match *experts {}
    }

    fn route(&self, logits: &CpuBuf, experts: usize, top_k: usize, normalize: bool, routing: &mut Routing) {
        moe::route(logits, experts, top_k, normalize, routing);
    }

    fn gather_routed(&self, x: &CpuBuf, routing: &Routing, expert: usize, out: &mut CpuBuf) -> usize {
        let width = x.len() / routing.rows().max(1);
        self.resize(out, routing.expert(expert).0.len() * width);
        moe::gather(x, width, routing, expert, out)
    }

    fn scatter_routed(&self, y: &CpuBuf, routing: &Routing, expert: usize, out: &mut CpuBuf) {
        let width = out.len() / routing.rows().max(1);
        moe::scatter_add(y, width, routing, expert, out);
    }

    fn store_kv(&self, layer: usize, k: &CpuBuf, v: &CpuBuf, kv: &mut (dyn BatchKv + '_)) {
        let kvd = k.len() / kv_rows(kv).max(1);
        let mut row = 0;
        for i in 0..kv.seqs() {
            let n = kv.span(i).1;
            kv.write(i, layer, &k[row * kvd..(row + n) * kvd], &v[row * kvd..(row + n) * kvd]);
            row += n;
        }
    }

    fn attention(
        &self,
        ws: &mut CpuWorkspace,
        layer: usize,
        q: &CpuBuf,
        k: &CpuBuf,
        v: &CpuBuf,
        kv: &mut (dyn BatchKv + '_),
        shape: AttnShape,
        mask: AttnMask,
        longest: usize,
        out: &mut CpuBuf,
    ) {
        let kvd = shape.num_kv_heads * shape.head_dim;
        let n_seqs = kv.seqs();
        ws.offsets.clear();
        let mut row = 0;
        for i in 0..n_seqs {
            let n = kv.span(i).1;
            ws.offsets.push(row);
            kv.write(i, layer, &k[row * kvd..(row + n) * kvd], &v[row * kvd..(row + n) * kvd]);
            row += n;
        }
        self.resize(out, q.len());
        let (kvr, offsets) = (&*kv, &ws.offsets);
        let seq = |i: usize| {
            let (pos0, rows) = kvr.span(i);
            let (k, v, layout) = kvr.layer(i, layer);
            SeqAttn {
                pos0,
                rows,
                offset: offsets[i],
                k,
                v,
                layout,
            }
        };
        attention_batch(
            self.kernels,
            &self.pool,
            q,
            n_seqs,
            &seq,
            longest,
            shape,
            mask,
            &mut ws.scores,
            out,
        );
    }
}

/// `ln(1 + e^x)`, as torch computes it in f32 (`x` itself above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// Rows the sequences of `kv` contribute to a batch.
fn kv_rows(kv: &(dyn BatchKv + '_)) -> usize {
    (0..kv.seqs()).map(|i| kv.span(i).1).sum()
}

/// Rows `tokens` of an f32 `table` into host rows `out`.
pub fn embed_rows(table: &Matrix, tokens: &[u32], out: &mut [f32]) -> Result<(), ForwardError> {
    let Matrix::F32 { data, cols } = table else {
        return Err(ForwardError::MissingPart("f32 embedding table"));
    };
    let (h, vocab) = (*cols, data.len() / cols);
    for (&id, row) in tokens.iter().zip(out.chunks_exact_mut(h)) {
        if id as usize >= vocab {
            return Err(ForwardError::TokenOutOfRange { id, vocab });
        }
        row.copy_from_slice(&data[id as usize * h..(id as usize + 1) * h]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_keeps_its_allocation_and_reports_the_length_asked_for() {
        let ops = CpuOps::reference();
        let mut b = CpuBuf::default();
        ops.upload(&[1.0, 2.0, 3.0], &mut b);
        assert_eq!(&*b, &[1.0, 2.0, 3.0]);
        ops.resize(&mut b, 1);
        assert_eq!(ops.len(&b), 1);
        let ptr = b.data.as_ptr();
        ops.resize(&mut b, 3);
        assert_eq!(
            b.data.as_ptr(),
            ptr,
            "growing within the allocation reallocates nothing"
        );
        let mut host = [0.0; 3];
        ops.download(&b, &mut host);
        assert_eq!(host, [1.0, 2.0, 3.0]);
    }

    #[test]
    fn every_operation_equals_the_scalar_reference_bit_for_bit() {
        // Enough rows that silu_mul spreads over the pool (16+), on one and three threads.
        for threads in [1, 3] {
            let ops = CpuOps::new(threads, None);
            for rows in [1, 5, 40] {
                let checks = super::super::conformance::check(&ops, rows);
                assert_eq!(checks.len(), 9);
                for c in checks {
                    assert_eq!(c.max_abs_diff, 0.0, "{threads} threads, {rows} rows: {c:?}");
                }
            }
        }
    }

    #[test]
    fn linear_attention_gives_the_same_bits_on_one_thread_and_on_several() {
        use crate::kv_cache::{AnyKv, BatchSeq, SequenceKv};
        // Heads of 64 × 64 over 37 rows: enough work that the heads go to the pool, and two
        // whole delta-rule windows then a tail when the rows are a prompt.
        let shape = LinearAttnShape {
            key_heads: 2,
            value_heads: 4,
            key_head_dim: 64,
            value_head_dim: 64,
            conv_kernel: 4,
            value_heads_tiled: false,
        };
        let (rows, nv, channels) = (37, shape.value_heads, shape.channels());
        let wave =
            |n: usize, seed: f32| -> Vec<f32> { (0..n).map(|i| ((i as f32 * 0.37 + seed).sin()) * 0.5).collect() };
        let run = |threads: usize, prompt_len: usize| {
            let ops = CpuOps::new(threads, None);
            let mut ws = CpuWorkspace::default();
            let (mut qkv, mut b, mut a, mut out) = (
                CpuBuf::default(),
                CpuBuf::default(),
                CpuBuf::default(),
                CpuBuf::default(),
            );
            ops.upload(&wave(rows * channels, 0.1), &mut qkv);
            ops.upload(&wave(rows * nv, 0.2), &mut b);
            ops.upload(&wave(rows * nv, 0.3), &mut a);
            let conv = wave(channels * shape.conv_kernel, 0.4);
            let dt_bias = wave(nv, 0.5);
            let a_rate: Vec<f32> = wave(nv, 0.6).iter().map(|v| -v.abs() - 0.1).collect();
            let mut kv = SequenceKv::with_state(1, 8, rows, 1, shape.state_values());
            let mut seqs = [BatchSeq {
                pos0: 0,
                len: rows,
                prompt_len,
                kv: &mut kv,
            }];
            let mut batch = AnyKv(&mut seqs[..]);
            ops.linear_attention(
                &mut ws,
                0,
                &qkv,
                &b,
                &a,
                [&conv, &dt_bias, &a_rate],
                shape,
                &mut batch,
                &mut out,
            );
            let state = batch.state(0, 0).to_vec();
            (out.to_vec(), state)
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // Token by token (decode rows), and as a prompt (two windows in the chunked form).
        for prompt_len in [0, rows] {
            let one = run(1, prompt_len);
            assert!(one.0.iter().any(|v| *v != 0.0), "the recurrence wrote its output");
            for threads in [2, 3] {
                let many = run(threads, prompt_len);
                assert_eq!(
                    bits(&many.0),
                    bits(&one.0),
                    "{threads} threads, prompt {prompt_len}: output"
                );
                assert_eq!(
                    bits(&many.1),
                    bits(&one.1),
                    "{threads} threads, prompt {prompt_len}: state"
                );
            }
        }
        // The two forms are the same function summed in different orders.
        let (steps, windows) = (run(1, 0), run(1, rows));
        assert_ne!(bits(&steps.0), bits(&windows.0), "the prompt took the chunked form");
        let off = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(
            off(&steps.0, &windows.0) < 1e-5,
            "outputs off by {}",
            off(&steps.0, &windows.0)
        );
        assert!(
            off(&steps.1, &windows.1) < 1e-5,
            "states off by {}",
            off(&steps.1, &windows.1)
        );
        // The tail after the last whole window is token by token: a prompt one window
        // shorter gives the first window's rows the same bits and the rest the steps' bits.
        let short = run(1, 16 + 5);
        let dv = shape.values();
        assert_eq!(bits(&short.0[..16 * dv]), bits(&windows.0[..16 * dv]));
        assert_ne!(bits(&short.0[16 * dv..32 * dv]), bits(&windows.0[16 * dv..32 * dv]));
    }

    #[test]
    fn embedding_refuses_ids_outside_the_vocabulary() {
        let ops = CpuOps::reference();
        let table = Matrix::F32 {
            data: vec![0.0, 1.0, 2.0, 3.0],
            cols: 2,
        };
        let mut out = CpuBuf::default();
        ops.embed(&table, &[1, 0], &mut out).unwrap();
        assert_eq!(&*out, &[2.0, 3.0, 0.0, 1.0]);
        assert_eq!(
            ops.embed(&table, &[2], &mut out),
            Err(ForwardError::TokenOutOfRange { id: 2, vocab: 2 })
        );
    }
}
