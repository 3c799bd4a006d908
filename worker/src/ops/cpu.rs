//! [`Ops`] on the CPU: the runtime-dispatched SIMD kernels on a thread pool sized to the socket.
//! Everything CPU-specific (the kernel path, the thread count, quantized activations) lives
//! here and in [`crate::kernels::cpu`]; model code never names it.

use std::sync::Arc;

use super::{AttnMask, AttnShape, HostMatrix, Ops, OpsInfo, Product};
use crate::kernels::cpu::attention::{SeqAttn, attention_batch};
use crate::kernels::cpu::dispatch::Kernels;
use crate::kernels::cpu::elementwise as ew;
use crate::kernels::cpu::matmul::{self, Matrix, WeightFormat};
use crate::kernels::cpu::moe::{self, Routing};
use crate::kernels::cpu::q8::QuantizedRows;
use crate::kv_cache::BatchKv;
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

    fn rope(&self, x: &mut CpuBuf, width: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = head_dim / 2;
        for (i, row) in x.chunks_exact_mut(width).enumerate() {
            let at = i * half..(i + 1) * half;
            ew::rope_rotate_half(self.kernels, row, head_dim, &cos[at.clone()], &sin[at]);
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
