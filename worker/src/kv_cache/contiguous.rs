//! Contiguous per-sequence KV: each sequence owns growable K/V buffers for the layers held.
//! The single-process engine and the in-process generator use it; pipeline stages use the
//! paged pool ([`super::paged`]).

use super::{BatchKv, KvSpans};
use crate::kernels::cpu::attention::{KvData, Rows};
use crate::model::ForwardError;

/// Keys and values of one layer: `capacity × kv_dim` each, rows in position order.
#[derive(Debug, Default)]
pub struct LayerKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// One sequence's KV for a stage's layers, and the recurrent state of its linear-attention
/// layers.
#[derive(Debug)]
pub struct SequenceKv {
    pub layers: Vec<LayerKv>,
    kv_dim: usize,
    len: usize,
    capacity: usize,
    /// `state_layers × state_values` f32s.
    state: Vec<f32>,
    state_values: usize,
}

impl SequenceKv {
    /// An empty cache for `n_layers` layers of width `kv_dim`, with room for `capacity` tokens.
    pub fn new(n_layers: usize, kv_dim: usize, capacity: usize) -> Self {
        let layers = (0..n_layers)
            .map(|_| LayerKv {
                k: vec![0.0; capacity * kv_dim],
                v: vec![0.0; capacity * kv_dim],
            })
            .collect();
        Self {
            layers,
            kv_dim,
            len: 0,
            capacity,
            state: Vec::new(),
            state_values: 0,
        }
    }

    /// [`new`](Self::new) with `state_layers` recurrent states of `state_values` f32s each.
    pub fn with_state(
        n_layers: usize,
        kv_dim: usize,
        capacity: usize,
        state_layers: usize,
        state_values: usize,
    ) -> Self {
        Self {
            state: vec![0.0; state_layers * state_values],
            state_values,
            ..Self::new(n_layers, kv_dim, capacity)
        }
    }

    /// Tokens stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens there is room for without growing.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes held by the key and value buffers and the recurrent state.
    pub fn bytes(&self) -> usize {
        let kv: usize = self.layers.iter().map(|l| l.k.len() + l.v.len()).sum();
        (kv + self.state.len()) * size_of::<f32>()
    }

    /// Make room for `total` tokens (doubling, so appends are amortised allocation-free).
    pub fn reserve(&mut self, total: usize) {
        if total <= self.capacity {
            return;
        }
        let cap = total.max(self.capacity * 2);
        for l in &mut self.layers {
            l.k.resize(cap * self.kv_dim, 0.0);
            l.v.resize(cap * self.kv_dim, 0.0);
        }
        self.capacity = cap;
    }

    /// Record that positions up to `len` are filled.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity,
            "KV length {len} beyond capacity {}",
            self.capacity
        );
        self.len = len;
    }

    /// Forget tokens from position `len` on (e.g. rejected speculative tokens).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// One sequence's share of a batched forward pass over contiguous caches.
#[derive(Debug)]
pub struct BatchSeq<'a> {
    /// Position of the sequence's first row in this batch (its KV must hold exactly this many).
    pub pos0: usize,
    /// Rows (tokens) of this sequence in the batch.
    pub len: usize,
    /// The sequence's prompt length (see [`KvSpans::prompt_len`]; 0: token by token).
    pub prompt_len: usize,
    pub kv: &'a mut SequenceKv,
}

impl KvSpans for [BatchSeq<'_>] {
    fn seqs(&self) -> usize {
        self.len()
    }

    fn span(&self, i: usize) -> (usize, usize) {
        (self[i].pos0, self[i].len)
    }

    fn stored(&self, i: usize) -> usize {
        self[i].kv.len()
    }

    fn prompt_len(&self, i: usize) -> usize {
        self[i].prompt_len
    }

    fn prepare(&mut self) -> Result<(), ForwardError> {
        for q in self.iter_mut() {
            q.kv.reserve(q.pos0 + q.len);
            if q.pos0 == 0 {
                q.kv.state.fill(0.0);
            }
        }
        Ok(())
    }

    fn commit(&mut self) {
        for q in self.iter_mut() {
            q.kv.set_len(q.pos0 + q.len);
        }
    }
}

impl BatchKv for [BatchSeq<'_>] {
    fn write(&mut self, i: usize, layer: usize, k: &[f32], v: &[f32]) {
        let q = &mut self[i];
        let d = q.kv.kv_dim;
        let (a, b) = (q.pos0 * d, (q.pos0 + q.len) * d);
        let l = &mut q.kv.layers[layer];
        l.k[a..b].copy_from_slice(k);
        l.v[a..b].copy_from_slice(v);
    }

    fn layer(&self, i: usize, layer: usize) -> (KvData<'_>, KvData<'_>, Rows<'_>) {
        let l = &self[i].kv.layers[layer];
        (KvData::F32(&l.k), KvData::F32(&l.v), Rows::Contiguous)
    }

    fn state(&mut self, i: usize, layer: usize) -> &mut [f32] {
        let kv = &mut *self[i].kv;
        let n = kv.state_values;
        &mut kv.state[layer * n..(layer + 1) * n]
    }
}
