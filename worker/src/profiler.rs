//! The stage profiler: what one decoder layer, the head and the embedding cost on this worker's
//! backend, at a ladder of batch sizes. The coordinator's split planner turns these into layer
//! ranges, so a slower worker gets fewer layers and the last stage's head is paid for with
//! layers given to the others.
//!
//! The profile loads its own copy of a few layers (with the embedding and the head) rather than
//! timing the stage a worker serves: it runs before any stage is assigned. It times a pass over
//! enough layers that their weights come from memory, not from the cache the previous
//! repetition filled, and the head after them, as a serving stage runs them. The pass's time
//! and bytes are reported for the model's layer 0, each timed layer weighted by the weights it
//! declares ([`crate::model::spec::LayerSpec`]); the planner scales them to every other layer
//! the same way, so a model whose layers differ is not planned as if they were alike.

use std::time::Instant;

use baton_shared::model_config::ModelConfig;
use baton_shared::model_files::ModelFiles;

use crate::backend::{self, BackendError, BackendOptions, SeqChunk, StageShape};
use crate::model::registry;
use crate::model::spec::{LayerClass, LayerSpec};
use crate::model::{ForwardError, PartBytes};

/// Largest batch a profile times.
pub const MAX_PROFILE_TOKENS: usize = 4096;
/// Longest context a profile's tokens attend over.
pub const MAX_PROFILE_CONTEXT: usize = 32768;
/// Most batch sizes one profile times.
pub const MAX_PROFILE_POINTS: usize = 32;
/// Most timed repetitions per point.
pub const MAX_PROFILE_REPS: usize = 100;
/// Most logits a profile's head may produce at once (1 GiB of f32).
const MAX_PROFILE_LOGITS: usize = 1 << 28;
/// Longest a profile keeps timing one point.
pub const MAX_PROFILE_POINT_SECONDS: f64 = 1.0;
/// Positions per block of the profile's own KV pool.
const BLOCK: usize = 16;
/// Layer weight bytes the timed pass streams at least (fewer layers if the model has fewer):
/// more than a last-level cache holds. Timing one small layer back to back measured it from
/// cache, about half what each layer of a serving stage costs when all its layers stream from
/// memory every step, and the split planner then gave stages uneven work.
const STREAM_BYTES: usize = 128 << 20;

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileSpec {
    /// Batch sizes to time: that many decode tokens, each from its own sequence.
    pub token_counts: Vec<usize>,
    /// KV positions every timed token attends over.
    pub context: usize,
    /// Timed repetitions per point (at least); their mean is kept.
    pub reps: usize,
    /// Keep repeating each point for at least this long: a burst of a few milliseconds runs at
    /// full speed even on a core another process shares (the scheduler credits a thread that
    /// slept), so only sustained timings show what serving will get.
    pub min_seconds: f64,
}

impl Default for ProfileSpec {
    /// Decode batches of 1 to 64 tokens at a 128-position context, at least 3 repetitions
    /// and 40 ms per point.
    fn default() -> Self {
        Self {
            token_counts: (0..7).map(|i| 1 << i).collect(),
            context: 128,
            reps: 3,
            min_seconds: 0.04,
        }
    }
}

/// Mean seconds for a batch of `tokens` tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostPoint {
    pub tokens: usize,
    pub seconds: f64,
}

/// What one layer of a class costs on this worker.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassCost {
    pub class: LayerClass,
    /// The model's first layer of this class, per batch size: the class's layers in the timed
    /// pass, each timed on its own and scaled to that layer by declared weights.
    pub layer: Vec<CostPoint>,
    /// Weight bytes of that layer (every expert of a mixture included).
    pub bytes: usize,
}

/// A worker's measured costs.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// The model's layer 0, attention over the context included (other layers scale by their
    /// declared weights).
    pub layer: Vec<CostPoint>,
    /// Each layer class the timed pass held, by [`LayerClass::index`]: the planner costs a
    /// model's layers by class, so a hybrid's linear-attention layers are not assumed to cost
    /// what its full-attention layers do per weight.
    pub classes: Vec<ClassCost>,
    /// Final norm, head and a greedy pick per row (what only the last stage does).
    pub head: Vec<CostPoint>,
    /// Token embedding (what only the first stage does).
    pub embed: Vec<CostPoint>,
    /// Weight bytes of one layer (`layers`), the embedding and the head.
    pub bytes: PartBytes,
    /// Kernel path or device the timings come from.
    pub kernels: String,
    pub threads: usize,
}

/// Why a profile could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error(
        "profile token counts must be 1 to {MAX_PROFILE_POINTS} distinct values, each between 1 and {MAX_PROFILE_TOKENS}; got {0:?}"
    )]
    TokenCounts(Vec<usize>),
    #[error("profile repetitions must be at most {MAX_PROFILE_REPS}; got {0}")]
    Reps(usize),
    #[error("profiling {tokens} rows of a {vocab}-token vocabulary needs more than {MAX_PROFILE_LOGITS} logits")]
    Logits { tokens: usize, vocab: usize },
    #[error("profile context of {0} positions is beyond the limit of {MAX_PROFILE_CONTEXT}")]
    Context(usize),
    #[error("profile time per point of {0} s is outside 0..={MAX_PROFILE_POINT_SECONDS} s")]
    MinSeconds(f64),
    #[error(
        "profiling {tokens} sequences at a context of {context} needs a KV pool of {need} bytes, more than this worker's KV budget of {budget} bytes (kv_cache_mib)"
    )]
    KvBudget {
        tokens: usize,
        context: usize,
        need: u128,
        budget: u64,
    },
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("a profiling run failed: {0}")]
    Forward(#[from] ForwardError),
}

impl ProfileSpec {
    /// Refuse batch sizes and contexts out of range.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let mut distinct = self.token_counts.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let bad = distinct.len() != self.token_counts.len()
            || !(1..=MAX_PROFILE_POINTS).contains(&distinct.len())
            || self.token_counts.iter().any(|&t| t == 0 || t > MAX_PROFILE_TOKENS);
        if bad {
            return Err(ProfileError::TokenCounts(self.token_counts.clone()));
        }
        if self.reps > MAX_PROFILE_REPS {
            return Err(ProfileError::Reps(self.reps));
        }
        if self.context > MAX_PROFILE_CONTEXT {
            return Err(ProfileError::Context(self.context));
        }
        if !(0.0..=MAX_PROFILE_POINT_SECONDS).contains(&self.min_seconds) {
            return Err(ProfileError::MinSeconds(self.min_seconds));
        }
        Ok(())
    }
}

/// Run `once` (which returns the seconds of each of its `N` timed parts) once to warm up, then
/// at least `reps` times and for at least `min_seconds` back to back; the mean of each part.
/// Not the median: on a core shared with another process most short repetitions fit in one
/// time slice and run at full speed, and the few that wait for the other process are exactly
/// what serving will see.
fn mean_seconds<const N: usize>(
    reps: usize,
    min_seconds: f64,
    mut once: impl FnMut() -> Result<[f64; N], ForwardError>,
) -> Result<[f64; N], ForwardError> {
    once()?;
    let start = Instant::now();
    let (mut n, mut total) = (0usize, [0f64; N]);
    while n < reps.max(1) || start.elapsed().as_secs_f64() < min_seconds {
        for (t, s) in total.iter_mut().zip(once()?) {
            *t += s;
        }
        n += 1;
    }
    Ok(total.map(|t| t / n as f64))
}

/// How many layers the timed pass runs: enough for [`STREAM_BYTES`] of weights of
/// `layer_bytes` each and to reach layer `reach - 1` (the first of the model's last-seen
/// class), at most the model's `num_layers`, and as many as `kv_budget` has room for at
/// `kv_per_layer` bytes each (at least one).
fn pass_layers(num_layers: usize, layer_bytes: usize, reach: usize, kv_per_layer: u128, kv_budget: u64) -> usize {
    let streamed = STREAM_BYTES.div_ceil(layer_bytes.max(1)).max(reach);
    let fits = (kv_budget as u128 / kv_per_layer.max(1)).min(usize::MAX as u128) as usize;
    streamed.min(num_layers).min(fits).max(1)
}

/// Each class's first layer among `specs`, by [`LayerClass::index`] (`None`: no such layer).
fn first_layers(specs: &[LayerSpec]) -> [Option<usize>; LayerClass::ALL.len()] {
    let mut first = [None; LayerClass::ALL.len()];
    for (l, s) in specs.iter().enumerate() {
        first[s.class().index()].get_or_insert(l);
    }
    first
}

/// The layers needed to hold one layer of every class: one past the first layer of the class
/// that appears last.
fn class_reach(first: &[Option<usize>]) -> usize {
    first.iter().flatten().map(|l| l + 1).max().unwrap_or(0)
}

/// Seconds of one layer of each class among `specs` (the timed pass's layers) from each
/// layer's `seconds`: the class's layers' time over their weights relative to `reference[c]`,
/// the class's first layer in the model. `None` for a class the pass does not hold.
fn class_seconds(
    specs: &[LayerSpec],
    seconds: &[f64],
    reference: &[usize; LayerClass::ALL.len()],
) -> [Option<f64>; LayerClass::ALL.len()] {
    let mut time = [0f64; LayerClass::ALL.len()];
    let mut weight = [0f64; LayerClass::ALL.len()];
    for (s, &t) in specs.iter().zip(seconds) {
        let c = s.class().index();
        time[c] += t;
        weight[c] += s.active_params as f64 / reference[c].max(1) as f64;
    }
    std::array::from_fn(|c| (weight[c] > 0.0).then(|| time[c] / weight[c]))
}

/// Time one layer, the head and the embedding of the model in `files` on the backend `opts`
/// describes (its KV geometry is the profile's own), within a KV budget of `kv_budget` bytes.
pub fn profile(
    files: &ModelFiles,
    config: &ModelConfig,
    opts: &BackendOptions,
    spec: &ProfileSpec,
    kv_budget: u64,
) -> Result<Profile, ProfileError> {
    spec.validate()?;
    let max_t = spec.token_counts.iter().copied().max().unwrap_or(1);
    if max_t.saturating_mul(config.vocab_size) > MAX_PROFILE_LOGITS {
        return Err(ProfileError::Logits {
            tokens: max_t,
            vocab: config.vocab_size,
        });
    }
    // Every timed token is a sequence of its own with `context` positions stored before it.
    let per_seq = (spec.context + 1).div_ceil(BLOCK);
    let opts = BackendOptions {
        kv_blocks: max_t * per_seq,
        kv_block_size: BLOCK,
        // A linear-attention layer's state for each timed sequence.
        state_slots: max_t,
        state_snapshots: 0,
        ..opts.clone()
    };
    let need = opts.kv_bytes(config, 0..1);
    if need > kv_budget as u128 {
        return Err(ProfileError::KvBudget {
            tokens: max_t,
            context: spec.context,
            need,
            budget: kv_budget,
        });
    }
    // One layer alone first, for its size.
    let one = StageShape {
        config: config.clone(),
        layers: 0..1,
        first: false,
        last: false,
    };
    let layer_bytes = backend::load_shape(files, &one, &opts)?.info().part_bytes.layers;
    let arch = registry::for_config(config);
    let model_specs: Vec<LayerSpec> = (0..config.num_layers).map(|l| arch.layer(config, l).spec()).collect();
    // Each class's first layer in the model: what its cost is reported for.
    let first_layer = first_layers(&model_specs);
    let reference = first_layer.map(|l| l.map_or(0, |l| model_specs[l].active_params));
    let reach = class_reach(&first_layer);
    let shape = StageShape {
        layers: 0..pass_layers(config.num_layers, layer_bytes, reach, need, kv_budget),
        first: true,
        last: true,
        ..one
    };
    let mut b = backend::load_shape(files, &shape, &opts)?;
    let tables: Vec<Vec<u32>> = (0..max_t)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let (h, vocab) = (config.hidden_size, config.vocab_size);
    let mut embedded = vec![0f32; max_t * h];
    let mut hidden = vec![0f32; max_t * h];
    let mut logits = vec![0f32; max_t * vocab];
    let info = b.info();
    // Layer 0's share of the pass, by weights: the pass is `timed / first` layer-0s (exactly
    // the layer count for a uniform model, so its profile is what it was).
    let specs = b.layer_specs().to_vec();
    let first = specs[0].active_params.max(1);
    let timed = specs.iter().map(|s| s.active_params).sum::<usize>().max(1);
    let pass_bytes = info.layer_bytes.clone();
    let mut out = Profile {
        layer: Vec::new(),
        classes: LayerClass::ALL
            .into_iter()
            .filter_map(|class| {
                // Bytes of the class's first layer, when the pass holds it.
                let bytes = *pass_bytes.get(first_layer[class.index()]?)?;
                Some(ClassCost {
                    class,
                    layer: Vec::new(),
                    bytes,
                })
            })
            .collect(),
        head: Vec::new(),
        embed: Vec::new(),
        bytes: info.part_bytes,
        kernels: info.kernels,
        threads: info.threads,
    };
    for &t in &spec.token_counts {
        let tokens: Vec<u32> = (0..t).map(|i| ((i * 7919 + 1) % vocab) as u32).collect();
        let seqs: Vec<SeqChunk<'_>> = tables[..t]
            .iter()
            .enumerate()
            .map(|(slot, table)| SeqChunk {
                pos0: spec.context,
                len: 1,
                stored: spec.context,
                table,
                state_slot: slot,
                prompt_len: 0,
            })
            .collect();
        let (embedded, hidden, logits) = (&mut embedded[..t * h], &mut hidden[..t * h], &mut logits[..t * vocab]);
        // One pass as a one-stage pipeline runs it, each part timed: the embedding, every
        // layer (weights streamed from memory), then the head (evicted by the layers).
        // The whole pass is timed untouched; each layer's time (which waits for the device
        // after every layer) in a second pass of the same tokens.
        let [embed, layers, head, per_layer @ ..] = mean_seconds(spec.reps, spec.min_seconds, || {
            let start = Instant::now();
            b.embed(&tokens, embedded)?;
            let embed = start.elapsed().as_secs_f64();
            hidden.copy_from_slice(embedded);
            let start = Instant::now();
            b.forward(hidden, &seqs)?;
            let layers = start.elapsed().as_secs_f64();
            let start = Instant::now();
            b.logits(hidden, logits)?;
            let picked: usize = logits.chunks_exact(vocab).map(argmax).sum();
            std::hint::black_box(picked);
            let head = start.elapsed().as_secs_f64();
            // The same rows again, timing each layer: the caches hold what the first pass
            // wrote, which a pass over the same positions overwrites alike.
            hidden.copy_from_slice(embedded);
            b.layer_times(true);
            b.forward(hidden, &seqs)?;
            let times = b.layer_times(false);
            let classes = class_seconds(&specs, &times, &reference);
            Ok([
                embed,
                layers,
                head,
                classes[0].unwrap_or(0.0),
                classes[1].unwrap_or(0.0),
                classes[2].unwrap_or(0.0),
                classes[3].unwrap_or(0.0),
            ])
        })?;
        for c in &mut out.classes {
            c.layer.push(CostPoint {
                tokens: t,
                seconds: per_layer[c.class.index()],
            });
        }
        let layer = layers / (timed as f64 / first as f64);
        out.embed.push(CostPoint {
            tokens: t,
            seconds: embed,
        });
        out.layer.push(CostPoint {
            tokens: t,
            seconds: layer,
        });
        out.head.push(CostPoint {
            tokens: t,
            seconds: head,
        });
    }
    out.bytes.layers = (out.bytes.layers as u128 * first as u128 / timed as u128) as usize;
    Ok(out)
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |best, (i, &v)| if v > best.1 { (i, v) } else { best },
        )
        .0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::spec::{CacheSpec, FfnKind, LayerKind};

    #[test]
    fn the_timed_pass_streams_enough_layers_within_the_model_and_the_kv_budget() {
        const MIB: usize = 1 << 20;
        // SmolLM2-135M in Q8_0: 3.7 MiB a layer, so every one of its 30 layers.
        assert_eq!(pass_layers(30, 3_700_000, 1, 1000, u64::MAX), 30);
        // Small layers of a deep model: just enough for STREAM_BYTES.
        assert_eq!(pass_layers(1000, MIB, 1, 1000, u64::MAX), STREAM_BYTES / MIB);
        assert_eq!(pass_layers(1000, MIB + 1, 1, 1000, u64::MAX), STREAM_BYTES / MIB);
        // ...or to the first layer of every class, if that is further.
        assert_eq!(pass_layers(1000, MIB, 200, 1000, u64::MAX), 200);
        // A layer larger than STREAM_BYTES streams on its own.
        assert_eq!(pass_layers(80, 2 * STREAM_BYTES, 1, 1000, u64::MAX), 1);
        assert_eq!(pass_layers(80, 2 * STREAM_BYTES, 4, 1000, u64::MAX), 4);
        // The KV budget caps the layers, but one is always timed (the caller refuses a budget
        // without room for one).
        assert_eq!(pass_layers(30, MIB, 1, 1000, 4500), 4);
        assert_eq!(pass_layers(30, MIB, 20, 1000, 4500), 4);
        assert_eq!(pass_layers(30, MIB, 1, 1000, 10), 1);
        assert_eq!(pass_layers(30, 0, 0, 0, 0), 1);
    }

    fn layer(kind: LayerKind, moe: bool, active_params: usize) -> LayerSpec {
        LayerSpec {
            kind,
            ffn: if moe {
                FfnKind::Moe { experts: 8, active: 2 }
            } else {
                FfnKind::Dense
            },
            cache: CacheSpec::Recurrent { values: 1 },
            weight_params: 4 * active_params,
            active_params,
        }
    }

    #[test]
    fn each_class_is_timed_from_its_own_layers_scaled_to_its_first() {
        use LayerKind::{Attention as F, LinearAttention as L};
        // Qwen3-Next's pattern: three linear-attention layers, then full attention.
        let specs = [
            layer(L, true, 100),
            layer(L, true, 100),
            layer(L, true, 100),
            layer(F, true, 120),
        ];
        assert_eq!(class_reach(&first_layers(&specs)), 4);
        assert_eq!(class_reach(&first_layers(&specs[..3])), 1);
        let mixed = first_layers(&[layer(F, false, 1), layer(F, true, 1), layer(F, false, 1)]);
        assert_eq!(class_reach(&mixed), 2);
        assert_eq!(mixed[LayerClass { kind: F, moe: false }.index()], Some(0));
        assert_eq!(mixed[LayerClass { kind: F, moe: true }.index()], Some(1));
        let mut reference = [0; 4];
        reference[LayerClass { kind: L, moe: true }.index()] = 100;
        reference[LayerClass { kind: F, moe: true }.index()] = 60;
        let secs = class_seconds(&specs, &[1.0, 2.0, 3.0, 4.0], &reference);
        // The linear layers' mean; the full-attention layer read twice its class's first
        // layer's weights, so that layer costs half.
        assert_eq!(secs[LayerClass { kind: L, moe: true }.index()], Some(2.0));
        assert_eq!(secs[LayerClass { kind: F, moe: true }.index()], Some(2.0));
        assert_eq!(secs[LayerClass { kind: F, moe: false }.index()], None);
    }
}
