//! What a model declares about each of its layers, so the profiler, the split planner and KV
//! sizing read it from the model instead of assuming every layer is alike.

/// What a layer computes to mix positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Full causal self-attention.
    Attention,
    /// Gated DeltaNet linear attention: a recurrent state per sequence.
    LinearAttention,
}

impl LayerKind {
    /// The name reported in logs and the cluster view.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Attention => "attention",
            LayerKind::LinearAttention => "linear_attention",
        }
    }
}

/// What a layer's feed-forward part is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnKind {
    /// One dense MLP.
    Dense,
    /// `active` of `experts` routed MLPs per position.
    Moe { experts: usize, active: usize },
}

impl FfnKind {
    /// The name reported in logs and the cluster view.
    pub fn name(self) -> &'static str {
        match self {
            FfnKind::Dense => "dense",
            FfnKind::Moe { .. } => "moe",
        }
    }
}

/// What a layer keeps per sequence between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSpec {
    /// Keys and values for every position: `kv_heads × head_dim` values each.
    Attention { kv_heads: usize, head_dim: usize },
    /// A fixed-size state per sequence, whatever its length: `values` f32s.
    Recurrent { values: usize },
}

impl CacheSpec {
    /// Values per position of each of K and V (0 for a layer without a K/V cache).
    pub fn kv_dim(self) -> usize {
        match self {
            CacheSpec::Attention { kv_heads, head_dim } => kv_heads * head_dim,
            CacheSpec::Recurrent { .. } => 0,
        }
    }

    /// f32 values of recurrent state per sequence (0 for a K/V layer).
    pub fn state_values(self) -> usize {
        match self {
            CacheSpec::Attention { .. } => 0,
            CacheSpec::Recurrent { values } => values,
        }
    }
}

/// Bytes a stage's caches take: per KV block (every attention layer's keys and values) and per
/// copy of one sequence's recurrent state (every linear-attention layer's, f32). The same
/// arithmetic sizes a worker's pool at load and the coordinator's block count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheBytes {
    pub per_block: usize,
    pub per_state: usize,
}

impl CacheBytes {
    /// The bytes of layers caching as `caches` say, in blocks of `block_size` positions whose
    /// values take `value_bytes` each.
    pub fn of(caches: impl IntoIterator<Item = CacheSpec>, block_size: usize, value_bytes: usize) -> Self {
        caches.into_iter().fold(Self::default(), |acc, c| Self {
            per_block: acc.per_block + 2 * block_size * c.kv_dim() * value_bytes,
            per_state: acc.per_state + c.state_values() * size_of::<f32>(),
        })
    }

    /// Bytes of `blocks` blocks and `states` state copies (slots and snapshots).
    pub fn total(self, blocks: usize, states: usize) -> u128 {
        self.per_block as u128 * blocks as u128 + self.per_state as u128 * states as u128
    }
}

/// Where each of a stage's layers keeps its cache: attention layers number their K/V slots
/// from 0, recurrent layers their state slots from 0, so neither pool holds room for the
/// other kind's layers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheLayout {
    /// Layer `i`'s slot within its kind's pool.
    pub slot: Vec<usize>,
    /// Layers with K/V.
    pub kv_layers: usize,
    /// Layers with recurrent state.
    pub state_layers: usize,
    /// f32 values of one recurrent layer's state (every such layer of a model has the same).
    pub state_values: usize,
}

impl CacheLayout {
    /// The layout of `specs`, in order.
    pub fn of(specs: &[LayerSpec]) -> Self {
        let mut out = Self::default();
        for s in specs {
            match s.cache {
                CacheSpec::Attention { .. } => {
                    out.slot.push(out.kv_layers);
                    out.kv_layers += 1;
                }
                CacheSpec::Recurrent { values } => {
                    out.slot.push(out.state_layers);
                    out.state_layers += 1;
                    out.state_values = out.state_values.max(values);
                }
            }
        }
        out
    }

    /// f32 values of recurrent state one sequence needs on this stage.
    pub fn state_per_sequence(&self) -> usize {
        self.state_layers * self.state_values
    }
}

/// What the profiler times separately and the planner costs separately: layers of one class
/// cost alike per weight they read, layers of two classes need not (a linear-attention layer
/// updates a state per sequence where a full-attention layer reads its K/V; a mixture of
/// experts reads only the experts a batch touches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerClass {
    pub kind: LayerKind,
    pub moe: bool,
}

impl LayerClass {
    /// Every class, in [`index`](Self::index) order.
    pub const ALL: [LayerClass; 4] = [
        LayerClass {
            kind: LayerKind::Attention,
            moe: false,
        },
        LayerClass {
            kind: LayerKind::Attention,
            moe: true,
        },
        LayerClass {
            kind: LayerKind::LinearAttention,
            moe: false,
        },
        LayerClass {
            kind: LayerKind::LinearAttention,
            moe: true,
        },
    ];

    /// This class's place in [`ALL`](Self::ALL).
    pub fn index(self) -> usize {
        2 * usize::from(self.kind == LayerKind::LinearAttention) + usize::from(self.moe)
    }

    /// The class named `name` (as [`name`](Self::name) writes it).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }

    /// The name profiles and the cluster view use, e.g. `linear_attention+moe`.
    pub fn name(self) -> &'static str {
        match (self.kind, self.moe) {
            (LayerKind::Attention, false) => "attention+dense",
            (LayerKind::Attention, true) => "attention+moe",
            (LayerKind::LinearAttention, false) => "linear_attention+dense",
            (LayerKind::LinearAttention, true) => "linear_attention+moe",
        }
    }
}

/// One layer as the model declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    pub kind: LayerKind,
    pub ffn: FfnKind,
    pub cache: CacheSpec,
    /// Weights in the layer (values, whatever their format).
    pub weight_params: usize,
    /// Weights one position reads: all of them, but for a mixture of experts only the
    /// experts it is routed to.
    pub active_params: usize,
}

impl LayerSpec {
    /// The class this layer is profiled and planned as.
    pub fn class(&self) -> LayerClass {
        LayerClass {
            kind: self.kind,
            moe: matches!(self.ffn, FfnKind::Moe { .. }),
        }
    }
}

/// The K/V width every layer of `specs` shares, or the two widths that differ (the paged pool
/// stores one width per stage).
pub fn uniform_kv_dim(specs: &[LayerSpec]) -> Result<usize, (usize, usize)> {
    let mut dims = specs.iter().map(|s| s.cache.kv_dim()).filter(|&d| d > 0);
    let Some(first) = dims.next() else { return Ok(0) };
    match dims.find(|&d| d != first) {
        Some(other) => Err((first, other)),
        None => Ok(first),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attn(kv_heads: usize, params: usize) -> LayerSpec {
        LayerSpec {
            kind: LayerKind::Attention,
            ffn: FfnKind::Dense,
            cache: CacheSpec::Attention { kv_heads, head_dim: 64 },
            weight_params: params,
            active_params: params,
        }
    }

    #[test]
    fn kv_width_is_shared_or_the_mismatch_is_named() {
        assert_eq!(uniform_kv_dim(&[attn(2, 1), attn(2, 1)]), Ok(128));
        assert_eq!(uniform_kv_dim(&[attn(2, 1), attn(4, 1)]), Err((128, 256)));
        assert_eq!(uniform_kv_dim(&[]), Ok(0));
    }

    #[test]
    fn layer_classes_are_named_and_indexed_both_ways() {
        for (i, c) in LayerClass::ALL.into_iter().enumerate() {
            assert_eq!(c.index(), i);
            assert_eq!(LayerClass::from_name(c.name()), Some(c));
        }
        assert_eq!(LayerClass::from_name("mamba"), None);
        let moe = LayerSpec {
            ffn: FfnKind::Moe { experts: 8, active: 2 },
            ..attn(2, 1)
        };
        assert_eq!(moe.class().name(), "attention+moe");
        assert_eq!(attn(2, 1).class().name(), "attention+dense");
    }
}
