//! Layer assignment. The measured split planner gives each worker a contiguous layer range so
//! that the slowest stage is as fast as it can be, from each worker's measured cost of one layer
//! (and of the embedding on the first stage and the head on the last) at the batch size the
//! pipeline will run; `even_split` and `ranges_from_cuts` are the unmeasured alternatives.

use std::ops::Range;

/// How the coordinator splits layers when no explicit cuts are given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SplitPolicy {
    /// From the workers' measured costs (`Worker.Profile`).
    #[default]
    Measured,
    /// By layer count alone.
    Even,
}

/// A `split` setting that is not one.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown split '{0}': expected measured or even")]
pub struct UnknownSplit(String);

impl std::str::FromStr for SplitPolicy {
    type Err = UnknownSplit;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "measured" | "" => Ok(Self::Measured),
            "even" => Ok(Self::Even),
            _ => Err(UnknownSplit(s.to_string())),
        }
    }
}

impl std::fmt::Display for SplitPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Measured => "measured",
            Self::Even => "even",
        })
    }
}

/// Longest a measured point may take: a layer slower than this is not a measurement, and the
/// bound keeps every sum of stage times finite.
pub const MAX_SECONDS: f64 = 1e6;

/// Seconds a part takes for a batch of tokens, from measured points.
#[derive(Debug, Clone, PartialEq)]
pub struct CostCurve {
    /// `(tokens, seconds)`, tokens strictly increasing.
    points: Vec<(usize, f64)>,
}

/// Measured points that cannot describe a cost.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("bad cost curve {0:?}: need at least one point, token counts increasing from 1, seconds in 0..={MAX_SECONDS}")]
pub struct BadCurve(Vec<(usize, f64)>);

impl CostCurve {
    /// A curve through `points` (sorted here by token count).
    pub fn new(mut points: Vec<(usize, f64)>) -> Result<Self, BadCurve> {
        points.sort_by_key(|p| p.0);
        let ok = !points.is_empty()
            && points[0].0 >= 1
            && points.windows(2).all(|w| w[0].0 < w[1].0)
            && points.iter().all(|p| (0.0..=MAX_SECONDS).contains(&p.1));
        if ok { Ok(Self { points }) } else { Err(BadCurve(points)) }
    }

    /// The same curve `factor` times slower (a worker sharing its core), capped at
    /// [`MAX_SECONDS`].
    pub fn slowed(&self, factor: f64) -> Self {
        let points = self
            .points
            .iter()
            .map(|&(t, s)| (t, (s * factor).min(MAX_SECONDS)))
            .collect();
        Self { points }
    }

    /// Seconds for `tokens`: linear between measured points, proportional below the first and
    /// along the last segment's slope beyond the last (never below the last point).
    pub fn at(&self, tokens: usize) -> f64 {
        let p = &self.points;
        let t = tokens as f64;
        let (t0, s0) = (p[0].0 as f64, p[0].1);
        if t <= t0 {
            return s0 * t / t0;
        }
        for w in p.windows(2) {
            let ((a, sa), (b, sb)) = ((w[0].0 as f64, w[0].1), (w[1].0 as f64, w[1].1));
            if t <= b {
                return sa + (sb - sa) * (t - a) / (b - a);
            }
        }
        let (tl, sl) = (p[p.len() - 1].0 as f64, p[p.len() - 1].1);
        let slope = match p.len() {
            1 => sl / tl,
            n => ((sl - p[n - 2].1) / (tl - p[n - 2].0 as f64)).max(0.0),
        };
        sl + slope * (t - tl)
    }
}

/// What the planner knows about one worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerCosts {
    /// One decoder layer.
    pub layer: CostCurve,
    /// The embedding, paid by the first stage.
    pub embed: CostCurve,
    /// Final norm, head and sampling, paid by the last stage.
    pub head: CostCurve,
    /// Weight bytes of one layer, of the embedding and of the head in the pipeline's format.
    pub layer_bytes: u64,
    pub embed_bytes: u64,
    pub head_bytes: u64,
    /// Bytes the worker can give weights; `None`: no limit known.
    pub weight_budget: Option<u64>,
}

impl WorkerCosts {
    /// This worker's costs `factor` times slower in every part (what served batches measured
    /// against its profile).
    pub fn slowed(&self, factor: f64) -> Self {
        Self {
            layer: self.layer.slowed(factor),
            embed: self.embed.slowed(factor),
            head: self.head.slowed(factor),
            ..self.clone()
        }
    }
}

/// The micro-batch a plan is made for: `tokens` rows through every layer, of which `sampled`
/// (the decode tokens and last prompt chunks) also go through the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    pub tokens: usize,
    pub sampled: usize,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub ranges: Vec<Range<usize>>,
    /// Predicted seconds of each stage for one micro-batch of `workload`.
    pub stage_seconds: Vec<f64>,
    pub workload: Workload,
}

impl Plan {
    /// The slowest stage's predicted seconds (what bounds throughput).
    pub fn bottleneck(&self) -> f64 {
        self.stage_seconds.iter().copied().fold(0.0, f64::max)
    }
}

/// Why no plan exists.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("cannot split {layers} layers into {stages} stages")]
    Shape { layers: usize, stages: usize },
    #[error("no split of {layers} layers fits the workers' memory: {detail}")]
    DoesNotFit { layers: usize, detail: String },
    #[error("the workers' costs admit no plan: {0}")]
    Costs(String),
}

/// Seconds and weight bytes of stage `i` of `n` holding `layers` layers on worker `w`.
pub(crate) fn stage_cost(w: &WorkerCosts, i: usize, n: usize, layers: f64, load: Workload) -> (f64, u64) {
    // Bytes come from the network: saturate rather than wrap past a budget (a float-to-integer
    // cast saturates too).
    let mut secs = layers * w.layer.at(load.tokens);
    let mut bytes = (layers * w.layer_bytes as f64) as u64;
    if i == 0 {
        secs += w.embed.at(load.tokens);
        bytes = bytes.saturating_add(w.embed_bytes);
    }
    if i + 1 == n {
        secs += w.head.at(load.sampled);
        bytes = bytes.saturating_add(w.head_bytes);
    }
    (secs, bytes)
}

/// Contiguous layer ranges for `workers`, in order, that minimize the slowest stage's time for
/// micro-batches of `workload`, each stage's weights within its worker's budget; among equally
/// slow splits, the one with the least total time (latency). Exact: two dynamic programs over
/// (stage, layers so far), O(stages × layers²).
pub fn plan(num_layers: usize, workers: &[WorkerCosts], workload: Workload) -> Result<Plan, PlanError> {
    plan_layers(&vec![1.0; num_layers], workers, workload)
}

/// [`plan`] for layers that differ: `layer_costs[l]` is layer `l`'s time and weight bytes
/// relative to the profiled layer (the model's declared weights, see
/// `baton_worker::model::spec::relative_costs`), so 1.0 for every layer of a uniform model.
pub fn plan_layers(layer_costs: &[f64], workers: &[WorkerCosts], workload: Workload) -> Result<Plan, PlanError> {
    let num_layers = layer_costs.len();
    // prefix[b] - prefix[a]: the layers a..b in units of the profiled layer (exact integers
    // for a uniform model, so its plans are what they were).
    let mut prefix = Vec::with_capacity(num_layers + 1);
    prefix.push(0.0);
    for c in layer_costs {
        prefix.push(prefix[prefix.len() - 1] + c);
    }
    let weight = |a: usize, b: usize| prefix[b] - prefix[a];
    let n = workers.len();
    if n == 0 || n > num_layers {
        return Err(PlanError::Shape {
            layers: num_layers,
            stages: n,
        });
    }
    let batch = Workload {
        tokens: workload.tokens.max(1),
        sampled: workload.sampled.max(1).min(workload.tokens.max(1)),
    };
    // cost(i, a, b): stage i holding layers a..b, or None when its weights do not fit.
    let cost = |i: usize, a: usize, b: usize| {
        let (secs, bytes) = stage_cost(&workers[i], i, n, weight(a, b), batch);
        let fits = workers[i].weight_budget.is_none_or(|budget| bytes <= budget);
        fits.then_some(secs)
    };
    // Pass 1: the least achievable bottleneck. best[i][b]: stages 0..=i over layers 0..b.
    let mut best = vec![vec![f64::INFINITY; num_layers + 1]; n];
    for (b, slot) in best[0].iter_mut().enumerate().skip(1) {
        *slot = cost(0, 0, b).unwrap_or(f64::INFINITY);
    }
    for i in 1..n {
        for b in i + 1..=num_layers {
            best[i][b] = (i..b)
                .filter_map(|a| cost(i, a, b).map(|c| best[i - 1][a].max(c)))
                .fold(f64::INFINITY, f64::min);
        }
    }
    let bottleneck = best[n - 1][num_layers];
    if !bottleneck.is_finite() {
        let detail = workers
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let budget = w
                    .weight_budget
                    .map_or("unlimited".to_string(), |b| format!("{b} bytes"));
                format!("worker {i}: {} bytes per layer, budget {budget}", w.layer_bytes)
            })
            .collect::<Vec<_>>()
            .join("; ");
        return Err(PlanError::DoesNotFit {
            layers: num_layers,
            detail,
        });
    }
    // Pass 2: the least total time among splits whose every stage is within the bottleneck
    // (with room for rounding). sum[i][b] and the cut that achieves it.
    let limit = bottleneck * (1.0 + 1e-9) + 1e-15;
    let within = |i, a, b| cost(i, a, b).filter(|&c| c <= limit);
    let mut sum = vec![vec![f64::INFINITY; num_layers + 1]; n];
    let mut cut = vec![vec![0usize; num_layers + 1]; n];
    for (b, slot) in sum[0].iter_mut().enumerate().skip(1) {
        *slot = within(0, 0, b).unwrap_or(f64::INFINITY);
    }
    for i in 1..n {
        for b in i + 1..=num_layers {
            for a in i..b {
                if let Some(c) = within(i, a, b) {
                    let total = sum[i - 1][a] + c;
                    if total < sum[i][b] {
                        sum[i][b] = total;
                        cut[i][b] = a;
                    }
                }
            }
        }
    }
    if !sum[n - 1][num_layers].is_finite() {
        return Err(PlanError::Costs(format!(
            "stage times do not add up to a finite total at bottleneck {bottleneck} s"
        )));
    }
    let mut ranges = vec![0..0; n];
    let mut end = num_layers;
    for i in (0..n).rev() {
        let start = if i == 0 { 0 } else { cut[i][end] };
        ranges[i] = start..end;
        end = start;
    }
    let stage_seconds = ranges
        .iter()
        .enumerate()
        .map(|(i, r)| stage_cost(&workers[i], i, n, weight(r.start, r.end), batch).0)
        .collect();
    Ok(Plan {
        ranges,
        stage_seconds,
        workload: batch,
    })
}

/// Split `num_layers` into `stages` contiguous ranges whose sizes differ by at most one
/// (earlier stages take the extra layers). Panics if there are more stages than layers.
pub fn even_split(num_layers: usize, stages: usize) -> Vec<Range<usize>> {
    assert!(
        stages > 0 && stages <= num_layers,
        "cannot split {num_layers} layers into {stages} stages"
    );
    let (base, extra) = (num_layers / stages, num_layers % stages);
    let mut start = 0;
    (0..stages)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

/// Ranges from explicit cut points (`[10, 20]` on 30 layers: 0..10, 10..20, 20..30).
pub fn ranges_from_cuts(num_layers: usize, cuts: &[usize]) -> Result<Vec<Range<usize>>, String> {
    let mut bounds = Vec::with_capacity(cuts.len() + 2);
    bounds.push(0);
    bounds.extend_from_slice(cuts);
    bounds.push(num_layers);
    if bounds.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!(
            "layer cuts {cuts:?} must be strictly increasing inside 1..{num_layers}"
        ));
    }
    Ok(bounds.windows(2).map(|w| w[0]..w[1]).collect())
}

/// A better split for workers whose speed drifted from their profiles.
#[derive(Debug, Clone, PartialEq)]
pub struct Drift {
    /// Each stage's worker speed against its profile, relative to the least slowed worker
    /// (1.0 for it; 2.0: half as fast as profiled, relative to the others).
    pub scales: Vec<f64>,
    /// Each stage's predicted seconds at the served workload, from the profiles.
    pub predicted: Vec<f64>,
    /// The current split's slowest stage under those speeds, in the plan's seconds.
    pub current: f64,
    /// The plan for those speeds; its bottleneck is at least `threshold` times faster.
    pub better: Plan,
}

/// Each stage's predicted seconds for one micro-batch of `workload` when worker `i` holds
/// `ranges[i]`.
pub fn stage_times(
    layer_costs: &[f64],
    workers: &[WorkerCosts],
    ranges: &[Range<usize>],
    workload: Workload,
) -> Vec<f64> {
    let n = ranges.len();
    ranges
        .iter()
        .zip(workers)
        .enumerate()
        .map(|(i, (r, w))| {
            let layers = layer_costs.get(r.clone()).map_or(0.0, |c| c.iter().sum());
            stage_cost(w, i, n, layers, workload).0
        })
        .collect()
}

/// Whether the current split should change, from `measured[i]`, stage `i`'s mean forward
/// seconds over the micro-batches served, whose mean shape was `workload` (every stage runs
/// the same batches). Each stage is predicted at that workload from `costs`, each worker's
/// costs are scaled by its measured ÷ predicted ratio, and a new plan is made; it is returned
/// when the current split's slowest stage is at least `threshold` times the new plan's and the
/// ranges differ.
pub fn drift(
    layer_costs: &[f64],
    costs: &[WorkerCosts],
    current: &[Range<usize>],
    measured: &[f64],
    workload: Workload,
    threshold: f64,
) -> Option<Drift> {
    let n = costs.len();
    if n < 2 || current.len() != n || measured.len() != n {
        return None;
    }
    let predicted = stage_times(layer_costs, costs, current, workload);
    let ratios: Vec<f64> = predicted
        .iter()
        .zip(measured)
        .map(|(&p, &m)| {
            if p > 0.0 && m.is_finite() && m > 0.0 {
                m / p
            } else {
                f64::NAN
            }
        })
        .collect();
    if ratios.iter().any(|r| !r.is_finite()) {
        return None;
    }
    let least = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let scales: Vec<f64> = ratios.iter().map(|r| r / least).collect();
    let slowed: Vec<WorkerCosts> = costs.iter().zip(&scales).map(|(c, &f)| c.slowed(f)).collect();
    let current_bottleneck = predicted.iter().zip(&scales).map(|(p, f)| p * f).fold(0.0, f64::max);
    let better = plan_layers(layer_costs, &slowed, workload).ok()?;
    (better.ranges != current && current_bottleneck >= threshold * better.bottleneck()).then_some(Drift {
        scales,
        predicted,
        current: current_bottleneck,
        better,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker whose layer costs `layer` seconds per token, embedding `embed` and head `head`
    /// per token, with no memory limit.
    fn linear(layer: f64, embed: f64, head: f64) -> WorkerCosts {
        let curve = |s: f64| CostCurve::new(vec![(1, s), (64, 64.0 * s)]).unwrap();
        WorkerCosts {
            layer: curve(layer),
            embed: curve(embed),
            head: curve(head),
            layer_bytes: 100,
            embed_bytes: 1000,
            head_bytes: 1000,
            weight_budget: None,
        }
    }

    /// Every split of `layers` into `workers.len()` non-empty contiguous ranges: the least
    /// bottleneck, and the least total time among splits within it.
    fn exhaustive(layers: usize, workers: &[WorkerCosts], batch: Workload) -> Option<(f64, f64)> {
        fn go(
            layers: usize,
            workers: &[WorkerCosts],
            batch: Workload,
            i: usize,
            start: usize,
            acc: &mut Vec<(f64, f64)>,
            cur: (f64, f64),
        ) {
            let n = workers.len();
            if i == n {
                if start == layers {
                    acc.push(cur);
                }
                return;
            }
            let max_end = if i + 1 == n { layers } else { layers - (n - i - 1) };
            for end in start + 1..=max_end {
                if i + 1 == n && end != layers {
                    continue;
                }
                let (secs, bytes) = stage_cost(&workers[i], i, n, (end - start) as f64, batch);
                if workers[i].weight_budget.is_some_and(|b| bytes > b) {
                    continue;
                }
                go(layers, workers, batch, i + 1, end, acc, (cur.0.max(secs), cur.1 + secs));
            }
        }
        let mut all = Vec::new();
        go(layers, workers, batch, 0, 0, &mut all, (0.0, 0.0));
        let m = all.iter().map(|c| c.0).fold(f64::INFINITY, f64::min);
        let s = all
            .iter()
            .filter(|c| c.0 <= m * (1.0 + 1e-9) + 1e-15)
            .map(|c| c.1)
            .fold(f64::INFINITY, f64::min);
        m.is_finite().then_some((m, s))
    }

    #[test]
    fn the_dynamic_program_matches_exhaustive_search() {
        // A small deterministic generator: the test needs variety, not a crate.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 1000) as f64 / 1000.0
        };
        for case in 0..400 {
            let layers = 1 + case % 9;
            let stages = 1 + (case / 9) % layers.min(4);
            let workers: Vec<WorkerCosts> = (0..stages)
                .map(|_| {
                    let mut w = linear(0.1 + next(), next() * 0.5, next() * 4.0);
                    w.layer_bytes = 50 + (next() * 100.0) as u64;
                    if next() < 0.3 {
                        w.weight_budget = Some(1000 + (next() * 800.0) as u64);
                    }
                    w
                })
                .collect();
            let tokens = 1 + (next() * 16.0) as usize;
            let batch = Workload {
                tokens,
                sampled: 1 + (next() * tokens as f64) as usize % tokens,
            };
            let expected = exhaustive(layers, &workers, batch);
            match plan(layers, &workers, batch) {
                Ok(p) => {
                    let (m, s) =
                        expected.unwrap_or_else(|| panic!("case {case}: planned {p:?}, exhaustive found none"));
                    assert!(
                        (p.bottleneck() - m).abs() <= 1e-9 * m,
                        "case {case}: {p:?} vs bottleneck {m}"
                    );
                    let total: f64 = p.stage_seconds.iter().sum();
                    assert!(
                        (total - s).abs() <= 1e-9 * s.max(1e-12),
                        "case {case}: total {total} vs {s}"
                    );
                    assert_eq!(p.ranges.len(), stages);
                    assert_eq!(p.ranges[0].start, 0);
                    assert_eq!(p.ranges[stages - 1].end, layers);
                    assert!(p.ranges.windows(2).all(|w| w[0].end == w[1].start));
                    assert!(p.ranges.iter().all(|r| !r.is_empty()));
                }
                Err(e) => assert!(expected.is_none(), "case {case}: {e}, exhaustive found {expected:?}"),
            }
        }
    }

    #[test]
    fn the_head_moves_layers_off_the_last_stage_and_slow_workers_get_fewer() {
        // SmolLM2-like: the head costs about 7 layers per sampled token.
        let same = [linear(1.0, 0.01, 7.0), linear(1.0, 0.01, 7.0)];
        let decode = |n| Workload { tokens: n, sampled: n };
        let p = plan(30, &same, decode(8)).unwrap();
        assert_eq!(p.ranges, vec![0..18, 18..30], "{p:?}");
        // Half of the rows are prompt tokens that skip the head: it weighs half as much.
        let p = plan(30, &same, Workload { tokens: 16, sampled: 8 }).unwrap();
        assert_eq!(p.ranges, vec![0..17, 17..30], "{p:?}");
        // Without a head cost the split is even.
        let p = plan(30, &[linear(1.0, 0.0, 0.0), linear(1.0, 0.0, 0.0)], decode(8)).unwrap();
        assert_eq!(p.ranges, vec![0..15, 15..30]);
        // A worker twice as slow per layer gets about half the layers of the other.
        let p = plan(30, &[linear(2.0, 0.0, 0.0), linear(1.0, 0.0, 0.0)], decode(8)).unwrap();
        assert_eq!(p.ranges, vec![0..10, 10..30]);
        assert!((p.bottleneck() - 8.0 * 20.0).abs() < 1e-9);
    }

    #[test]
    fn memory_budgets_bind_and_are_named_when_nothing_fits() {
        let mut small = linear(1.0, 0.0, 0.0);
        small.weight_budget = Some(1000 + 5 * 100);
        let one = Workload { tokens: 1, sampled: 1 };
        let p = plan(30, &[small.clone(), linear(1.0, 0.0, 0.0)], one).unwrap();
        assert_eq!(
            p.ranges,
            vec![0..5, 5..30],
            "stage 0 holds the embedding and 5 layers at most"
        );
        small.weight_budget = Some(999);
        let e = plan(30, &[small, linear(1.0, 0.0, 0.0)], one).unwrap_err();
        assert!(
            e.to_string().contains("worker 0") && e.to_string().contains("budget 999 bytes"),
            "{e}"
        );
        assert!(matches!(
            plan(2, &vec![linear(1.0, 0.0, 0.0); 3], one),
            Err(PlanError::Shape { .. })
        ));
        // Byte counts from a worker near u64::MAX saturate instead of wrapping under a budget.
        let mut huge = linear(1.0, 0.0, 0.0);
        huge.layer_bytes = u64::MAX / 2;
        huge.weight_budget = Some(u64::MAX - 1);
        // Any stage of 2 or more layers is over budget (3 layers would wrap to below it).
        let e = plan(30, &[huge.clone(), huge], one).unwrap_err();
        assert!(matches!(e, PlanError::DoesNotFit { .. }), "{e}");
    }

    #[test]
    fn cost_curves_interpolate_and_extrapolate() {
        let c = CostCurve::new(vec![(4, 4.0), (1, 2.0), (16, 10.0)]).unwrap();
        assert_eq!(c.at(1), 2.0);
        assert_eq!(c.at(2), 2.0 + 2.0 / 3.0);
        assert_eq!(c.at(10), 7.0);
        assert_eq!(c.at(32), 10.0 + 16.0 * 0.5, "the last slope continues");
        let one = CostCurve::new(vec![(8, 4.0)]).unwrap();
        assert_eq!((one.at(4), one.at(16)), (2.0, 8.0));
        for bad in [
            vec![],
            vec![(0, 1.0)],
            vec![(1, f64::NAN)],
            vec![(2, 1.0), (2, 3.0)],
            vec![(1, -1.0)],
            vec![(1, 1e300)],
        ] {
            assert!(CostCurve::new(bad).is_err());
        }
        assert_eq!("Even".parse::<SplitPolicy>(), Ok(SplitPolicy::Even));
        assert!(
            "fastest"
                .parse::<SplitPolicy>()
                .unwrap_err()
                .to_string()
                .contains("'fastest'")
        );
    }

    #[test]
    fn layers_that_cost_more_go_to_fewer_per_stage() {
        let same = [linear(1.0, 0.0, 0.0), linear(1.0, 0.0, 0.0)];
        let one = Workload { tokens: 1, sampled: 1 };
        let uniform = plan_layers(&[1.0; 6], &same, one).unwrap();
        assert_eq!(uniform, plan(6, &same, one).unwrap());
        assert_eq!(uniform.ranges, vec![0..3, 3..6]);
        // The last two layers weigh three times as much: an even split would be 3 against 7;
        // 1+1+1+1 against 3+3 is the best there is.
        let p = plan_layers(&[1.0, 1.0, 1.0, 1.0, 3.0, 3.0], &same, one).unwrap();
        assert_eq!(p.ranges, vec![0..4, 4..6]);
        assert!((p.bottleneck() - 6.0).abs() < 1e-9, "{p:?}");
    }

    #[test]
    fn explicit_cuts() {
        assert_eq!(ranges_from_cuts(3, &[1]).unwrap(), vec![0..1, 1..3]);
        assert!(ranges_from_cuts(3, &[0]).is_err());
        assert!(ranges_from_cuts(3, &[2, 2]).is_err());
        assert!(ranges_from_cuts(3, &[3]).is_err());
    }

    #[test]
    fn splits_are_contiguous_and_balanced() {
        assert_eq!(even_split(30, 2), vec![0..15, 15..30]);
        assert_eq!(even_split(3, 3), vec![0..1, 1..2, 2..3]);
        assert_eq!(even_split(7, 3), vec![0..3, 3..5, 5..7]);
        for n in 1..12 {
            for s in 1..=n {
                let r = even_split(n, s);
                assert_eq!(r.first().unwrap().start, 0);
                assert_eq!(r.last().unwrap().end, n);
                assert!(r.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }

    #[test]
    fn a_worker_slowed_against_its_profile_gets_fewer_layers() {
        let workers = [linear(1e-3, 1e-4, 2e-3), linear(1e-3, 1e-4, 2e-3)];
        let load = Workload { tokens: 8, sampled: 4 };
        let costs = vec![1.0; 30];
        let plan = plan_layers(&costs, &workers, load).unwrap();
        assert_eq!(stage_times(&costs, &workers, &plan.ranges, load), plan.stage_seconds);
        let drifted = |measured: &[f64], load| drift(&costs, &workers, &plan.ranges, measured, load, 1.15);
        // Served batches took what the profile says (at whatever speed): nothing to change.
        let half: Vec<f64> = plan.stage_seconds.iter().map(|s| s * 0.5).collect();
        assert_eq!(drifted(&half, load), None);
        // Decode-only traffic: the head weighs more than in the planned mix, but stage times
        // that match the profiles at that workload are no drift.
        let decode = Workload { tokens: 4, sampled: 4 };
        let at_decode = stage_times(&costs, &workers, &plan.ranges, decode);
        assert_eq!(drifted(&at_decode, decode), None);
        // The second worker now takes twice as long as profiled (relative to the first).
        let slowed = [plan.stage_seconds[0] * 0.5, plan.stage_seconds[1]];
        let d = drifted(&slowed, load).unwrap();
        assert_eq!(d.scales, [1.0, 2.0]);
        assert_eq!(d.predicted, plan.stage_seconds);
        assert!(d.better.ranges[1].len() < plan.ranges[1].len(), "{:?}", d.better.ranges);
        assert!(d.current >= 1.15 * d.better.bottleneck());
        // The same plan made from the slowed costs directly.
        let direct = plan_layers(&costs, &[workers[0].clone(), workers[1].slowed(2.0)], load).unwrap();
        assert_eq!(d.better, direct);
        // A drift smaller than the threshold is left alone (hysteresis against noise).
        let slight = [plan.stage_seconds[0], plan.stage_seconds[1] * 1.05];
        assert_eq!(drifted(&slight, load), None);
        // Nonsense measurements change nothing.
        assert_eq!(drifted(&[0.0, plan.stage_seconds[1]], load), None);
    }
}
