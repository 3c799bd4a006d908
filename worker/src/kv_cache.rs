//! Contiguous per-sequence KV cache for the layers a stage holds (the paged cache shared with
//! the coordinator's block tables replaces this in the batching work).

/// Keys and values of one layer: `capacity × kv_dim` each, rows in position order.
#[derive(Debug, Default)]
pub struct LayerKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// One sequence's KV for a stage's layers.
#[derive(Debug)]
pub struct SequenceKv {
    pub layers: Vec<LayerKv>,
    kv_dim: usize,
    len: usize,
    capacity: usize,
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
