//! Step limits sized from measurement: how many tokens a micro-batch carries and how many
//! sequences run at once, when the user has not set them. Both come from the workers' profiled
//! cost curves (the same ones the split planner uses) and the KV pool, so a GPU worker gets
//! the large batches it needs and a one-thread CPU stage the small ones that keep it
//! responsive, without anyone finding a flag.
//!
//! * Tokens per step: the smallest size of which a one-row micro-batch's cost (reading the
//!   weights once, the work every micro-batch does) is at most [`FIXED_SHARE`] on the slowest
//!   stage, so its matrix products run at full speed; but no larger than a micro-batch that
//!   stage finishes within [`STEP_SECONDS`] (so a prompt chunk holds up the running
//!   sequences' next tokens only that long). Each of the stages' micro-batches in flight
//!   carries an equal part of it, so a long prompt crosses a pipeline as that many chunks.
//!   Measured on a 2-vCPU Xeon with SmolLM2 (bench/ttft-ab.sh, 1,060-token prompts): judging by
//!   the profile's cost per row instead chose 32-token chunks for one stage, and per-chunk
//!   overheads the profile does not see made the first token 9% later than with 128; giving
//!   each of two stages the whole size (128-token chunks) made it 6% later than 64.
//! * Running sequences: decode rows per micro-batch sized the same way (rows through the head
//!   too), times the stages (one micro-batch per stage in flight); at most what the KV pool
//!   holds at [`PLANNED_POSITIONS`] positions a sequence, and at most [`MAX_RUNNING`].
//!   Admission still reserves each prompt's blocks and preemption still makes room, as vLLM
//!   does beneath its `max_num_seqs`. For a model with linear-attention layers, also at most
//!   the sequences whose recurrent-state slot fits beside their planned K/V on every stage
//!   (after the prefix cache's state snapshots): every stage allocates a slot per running
//!   sequence when it loads.

use std::ops::Range;

use crate::planner::{LayerTable, WorkerCosts, Workload, stage_cost};

/// Sizes tried for a micro-batch (rows).
pub const CANDIDATE_ROWS: [usize; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];
/// A micro-batch is large enough when a one-row micro-batch costs at most this share of it.
pub const FIXED_SHARE: f64 = 0.1;
/// Longest a micro-batch may take on the slowest stage, in seconds (the bound on how long a
/// prompt chunk or a large decode batch delays the next token of everyone in it).
pub const STEP_SECONDS: f64 = 0.1;
/// Positions the KV pool is planned to hold for each running sequence before preemption is
/// needed (the model's context when that is shorter).
pub const PLANNED_POSITIONS: usize = 1024;
/// Most running sequences the sizing chooses.
pub const MAX_RUNNING: usize = 256;
/// Running sequences where nothing is measured (the in-process stage), within the KV bound.
pub const UNMEASURED_MAX_RUNNING: usize = 8;
/// The running limit of a model with linear-attention layers where nothing is measured (the
/// in-process stage): as many recurrent-state slots as a stage keeps unless told
/// ([`baton_worker::backend::DEFAULT_STATE_SLOTS`]).
pub const HYBRID_MAX_RUNNING: usize = baton_worker::backend::DEFAULT_STATE_SLOTS;
/// Tokens per step where nothing is measured.
pub const UNMEASURED_MAX_BATCH_TOKENS: usize = 128;

/// The sequences whose recurrent-state slot fits in a stage's KV budget of `budget` bytes
/// beside the prefix cache's `snapshots` state copies, each sequence with its planned K/V
/// ([`PLANNED_POSITIONS`], or `max_context` when shorter, in blocks of `block_size`), for a
/// stage whose caches take `bytes` (its `per_state` not 0).
pub fn state_sequences(
    bytes: baton_worker::model::spec::CacheBytes,
    budget: u64,
    snapshots: usize,
    block_size: usize,
    max_context: usize,
) -> usize {
    let blocks = PLANNED_POSITIONS.min(max_context.max(1)).div_ceil(block_size.max(1));
    let left = (budget as u128).saturating_sub(bytes.total(0, snapshots));
    (left / bytes.total(blocks, 1).max(1)).min(usize::MAX as u128) as usize
}

/// Which limits the user left to be sized (an explicit setting is kept as it is).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AutoLimits {
    pub max_running: bool,
    pub max_batch_tokens: bool,
}

impl AutoLimits {
    /// Both limits set by the user: nothing is sized.
    pub const NONE: Self = Self {
        max_running: false,
        max_batch_tokens: false,
    };

    /// Whether anything is left to size.
    pub fn any(self) -> bool {
        self.max_running || self.max_batch_tokens
    }
}

/// The limits a pipeline runs with, and what bounded each.
#[derive(Debug, Clone, PartialEq)]
pub struct StepLimits {
    pub max_running: usize,
    /// Tokens per step over all stages (each micro-batch in flight takes an equal part).
    pub max_batch_tokens: usize,
    /// `set` (by the user), `kv_pool`, `state_memory`, `step_cost`, `cap` or `unmeasured`.
    pub running_bound: &'static str,
    /// `set`, `amortized`, `step_seconds`, `decode_rows` or `unmeasured`.
    pub tokens_bound: &'static str,
}

impl StepLimits {
    /// These limits within the KV pool a built pipeline really has (`kv_positions` in all):
    /// a running limit left to the sizing comes down to what the pool holds at
    /// [`PLANNED_POSITIONS`] a sequence, since sizing only estimated the pool (for an even
    /// split, before the planner chose the ranges).
    pub fn within_pool(mut self, auto: AutoLimits, kv_positions: usize, max_context: usize) -> Self {
        let bound = kv_bound(kv_positions, max_context);
        if auto.max_running && bound < self.max_running {
            self.max_running = bound;
            self.running_bound = "kv_pool";
        }
        self
    }

    /// These limits with a running limit left to the sizing at most `state_sequences`: the
    /// sequences whose recurrent state fits on every stage (None: no stage keeps any).
    pub fn within_state(mut self, auto: AutoLimits, state_sequences: Option<usize>) -> Self {
        if let Some(bound) = state_sequences.filter(|&b| auto.max_running && b < self.max_running) {
            self.max_running = bound.max(1);
            self.running_bound = "state_memory";
        }
        self
    }

    /// The JSON `/admin/cluster` shows.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "max_running": self.max_running,
            "max_batch_tokens": self.max_batch_tokens,
            "max_running_bound": self.running_bound,
            "max_batch_tokens_bound": self.tokens_bound,
        })
    }
}

/// Each stage's measured costs and the layers it would hold.
pub struct StageCosts<'a> {
    pub workers: &'a [WorkerCosts],
    pub ranges: &'a [Range<usize>],
    /// The model's layers as the planner costs them.
    pub layers: &'a LayerTable,
}

impl StageCosts<'_> {
    /// Seconds of the slowest stage for a micro-batch of `rows` rows, `sampled` of which go
    /// through the head.
    pub fn bottleneck(&self, rows: usize, sampled: usize) -> f64 {
        let n = self.workers.len();
        let load = Workload { tokens: rows, sampled };
        let mut slowest: f64 = 0.0;
        for (i, (w, r)) in self.workers.iter().zip(self.ranges).enumerate() {
            slowest = slowest.max(stage_cost(w, self.layers, (i, n), r.clone(), load).0);
        }
        slowest
    }
}

/// The rows a micro-batch should carry by `cost(rows)`: the smallest candidate that amortizes
/// a one-row micro-batch's cost to [`FIXED_SHARE`] (the largest if none does), unless that
/// takes longer than [`STEP_SECONDS`] (then the largest that does not, and at least one row).
/// Whether the time bound decided it.
fn rows_for(cost: impl Fn(usize) -> f64) -> (usize, bool) {
    let one = cost(1);
    let fast = CANDIDATE_ROWS
        .iter()
        .copied()
        .find(|&r| one <= FIXED_SHARE * cost(r))
        .unwrap_or(CANDIDATE_ROWS[CANDIDATE_ROWS.len() - 1]);
    let in_time = CANDIDATE_ROWS
        .iter()
        .copied()
        .filter(|&r| cost(r) <= STEP_SECONDS)
        .max()
        .unwrap_or(1);
    if in_time < fast { (in_time, true) } else { (fast, false) }
}

/// Sequences a pool of `kv_positions` holds at [`PLANNED_POSITIONS`] each (the model's context
/// when shorter), at least one.
fn kv_bound(kv_positions: usize, max_context: usize) -> usize {
    (kv_positions / PLANNED_POSITIONS.min(max_context.max(1))).max(1)
}

/// Size the limits `auto` leaves open for a pipeline of `stages` stages whose KV pool holds
/// `kv_positions` positions per sequence slot in all, keeping the `set_*` values otherwise.
/// Without measured costs the running limit is the KV bound within `set_running` (the default)
/// and the token budget stays `set_tokens`.
pub fn size(
    auto: AutoLimits,
    set_running: usize,
    set_tokens: usize,
    stages: usize,
    costs: Option<&StageCosts<'_>>,
    kv_positions: usize,
    max_context: usize,
) -> StepLimits {
    let stages = stages.max(1);
    let kv_bound = kv_bound(kv_positions, max_context);
    let (max_running, running_bound) = match (auto.max_running, costs) {
        (false, _) => (set_running, "set"),
        (true, None) => (
            set_running.min(kv_bound),
            if kv_bound < set_running {
                "kv_pool"
            } else {
                "unmeasured"
            },
        ),
        (true, Some(c)) => {
            let (rows, _) = rows_for(|r| c.bottleneck(r, r));
            let by_cost = rows * stages;
            [(by_cost, "step_cost"), (kv_bound, "kv_pool"), (MAX_RUNNING, "cap")]
                .into_iter()
                .min_by_key(|(n, _)| *n)
                .expect("three bounds")
        }
    };
    let (max_batch_tokens, tokens_bound) = match (auto.max_batch_tokens, costs) {
        (false, _) => (set_tokens, "set"),
        (true, None) => (set_tokens.max(max_running), "unmeasured"),
        (true, Some(c)) => {
            // A prompt chunk: every row through the layers, one through the head.
            let (rows, timed) = rows_for(|r| c.bottleneck(r, 1));
            // Each micro-batch in flight must still fit its share of the decode rows.
            let decode_rows = max_running.div_ceil(stages) * stages;
            if decode_rows > rows {
                (decode_rows, "decode_rows")
            } else {
                (rows, if timed { "step_seconds" } else { "amortized" })
            }
        }
    };
    StepLimits {
        max_running,
        max_batch_tokens,
        running_bound,
        tokens_bound,
    }
}

#[cfg(test)]
// One stage's layers are a one-range slice, not a mistaken range-to-vec.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;
    use crate::planner::CostCurve;

    /// A worker whose layer costs `fixed + per_row · rows` seconds (weights read once per
    /// micro-batch, then work per row), with a negligible embedding and head.
    fn worker(fixed: f64, per_row: f64) -> WorkerCosts {
        let pts = |f: f64, p: f64| {
            CostCurve::new(
                [1usize, 2, 4, 8, 16, 32, 64]
                    .iter()
                    .map(|&t| (t, f + p * t as f64))
                    .collect(),
            )
            .unwrap()
        };
        WorkerCosts {
            layer: pts(fixed, per_row),
            classes: Vec::new(),
            embed: pts(0.0, 1e-9),
            head: pts(0.0, 1e-9),
            layer_bytes: 1,
            embed_bytes: 1,
            head_bytes: 1,
            weight_budget: None,
        }
    }

    fn sized(workers: &[WorkerCosts], ranges: &[Range<usize>], kv_positions: usize) -> StepLimits {
        let c = StageCosts {
            workers,
            ranges,
            layers: &LayerTable::uniform(ranges.last().map_or(0, |r| r.end)),
        };
        let auto = AutoLimits {
            max_running: true,
            max_batch_tokens: true,
        };
        size(auto, 8, 128, ranges.len(), Some(&c), kv_positions, 8192)
    }

    #[test]
    fn a_weight_bound_device_gets_large_batches_and_a_compute_bound_one_small() {
        // GPU-like: reading the weights dominates; rows are nearly free until hundreds.
        let gpu = sized(&[worker(1e-4, 1e-7)], &[0..30], 1 << 20);
        assert_eq!((gpu.max_running, gpu.running_bound), (256, "cap"));
        assert_eq!((gpu.max_batch_tokens, gpu.tokens_bound), (512, "amortized"));
        // CPU-like, one thread a stage: amortizing one row to a tenth needs 100 rows, but 15
        // layers take 100 ms at 56: micro-batches of 32 rows.
        let cpu = sized(&[worker(1e-3, 1e-4), worker(1e-3, 1e-4)], &[0..15, 15..30], 1 << 20);
        assert_eq!((cpu.max_running, cpu.running_bound), (2 * 32, "step_cost"));
        // The step's tokens must carry those 64 decode rows (32 a micro-batch).
        assert_eq!((cpu.max_batch_tokens, cpu.tokens_bound), (64, "decode_rows"));
        // Cheaper weights are amortized sooner: 28 rows, so 32, well within the time.
        let fast = sized(&[worker(2e-4, 1e-4)], &[0..15], 1 << 20);
        assert_eq!((fast.max_batch_tokens, fast.tokens_bound), (32, "amortized"));
    }

    #[test]
    fn the_kv_pool_bounds_running_sequences_and_the_budget_fits_their_rows() {
        // 40,000 positions hold 39 sequences of 1,024 positions.
        let s = sized(&[worker(1e-4, 1e-7)], &[0..30], 40_000);
        assert_eq!((s.max_running, s.running_bound), (39, "kv_pool"));
        // Rows cost the same at any size (16 rows amortize one); the decode rows need more.
        let c = [worker(1e-6, 1e-3)];
        let costs = StageCosts {
            workers: &c,
            ranges: &[0..1],
            layers: &LayerTable::uniform(1),
        };
        let auto = AutoLimits {
            max_running: false,
            max_batch_tokens: true,
        };
        let s = size(auto, 40, 128, 1, Some(&costs), 1 << 20, 8192);
        assert_eq!((s.max_running, s.running_bound), (40, "set"));
        assert_eq!((s.max_batch_tokens, s.tokens_bound), (40, "decode_rows"));
    }

    #[test]
    fn set_limits_are_kept_and_unmeasured_ones_fall_back_to_the_defaults_within_the_pool() {
        let s = size(AutoLimits::NONE, 3, 32, 2, None, 1 << 20, 8192);
        assert_eq!(
            (s.max_running, s.max_batch_tokens, s.running_bound, s.tokens_bound),
            (3, 32, "set", "set")
        );
        let auto = AutoLimits {
            max_running: true,
            max_batch_tokens: true,
        };
        let s = size(auto, 8, 128, 2, None, 1 << 20, 8192);
        assert_eq!(
            (s.max_running, s.max_batch_tokens, s.running_bound),
            (8, 128, "unmeasured")
        );
        // A short model context plans fewer positions per sequence.
        let s = size(auto, 8, 128, 2, None, 5 * 512, 512);
        assert_eq!((s.max_running, s.running_bound), (5, "kv_pool"));
        // The built pipeline's real pool lowers a sized limit, never a set one, never raises.
        let lowered = s.clone().within_pool(auto, 3 * 512, 512);
        assert_eq!((lowered.max_running, lowered.running_bound), (3, "kv_pool"));
        assert_eq!(s.clone().within_pool(auto, 50 * 512, 512), s);
        let set = size(AutoLimits::NONE, 8, 128, 2, None, 1 << 20, 8192);
        assert_eq!(set.clone().within_pool(AutoLimits::NONE, 512, 512), set);
    }

    #[test]
    fn a_sized_running_limit_comes_down_to_the_state_slots_that_fit() {
        let auto = AutoLimits {
            max_running: true,
            max_batch_tokens: false,
        };
        let s = size(auto, 64, 128, 2, None, 1 << 20, 8192);
        let lowered = s.clone().within_state(auto, Some(5));
        assert_eq!((lowered.max_running, lowered.running_bound), (5, "state_memory"));
        assert_eq!(s.clone().within_state(auto, None), s, "no stage keeps state");
        assert_eq!(
            s.clone().within_state(auto, Some(1000)),
            s,
            "a looser bound changes nothing"
        );
        assert_eq!(s.clone().within_state(auto, Some(0)).max_running, 1, "at least one");
        let set = size(AutoLimits::NONE, 64, 128, 2, None, 1 << 20, 8192);
        assert_eq!(
            set.clone().within_state(AutoLimits::NONE, Some(5)),
            set,
            "a set limit is kept"
        );
    }
}
