//! Layer assignment. The measured split planner gives each worker a contiguous layer range so
//! that the slowest stage is as fast as it can be, from each worker's measured cost of one layer
//! (and of the embedding on the first stage and the head on the last) at the batch size the
//! pipeline will run; `even_split` and `ranges_from_cuts` are the unmeasured alternatives.

use std::ops::Range;

mod shapes;

pub use shapes::{Drift, Shape, ShapeFit, ShapedPlan, drift, plan_shapes, shape_fits};

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

    /// The pointwise mean of `curves`, or `None` unless all were measured at the same token
    /// counts.
    pub fn mean(curves: &[&CostCurve]) -> Option<Self> {
        let first = curves.first()?;
        let same_grid = curves
            .iter()
            .all(|c| c.points.iter().map(|p| p.0).eq(first.points.iter().map(|p| p.0)));
        same_grid.then(|| Self {
            points: (0..first.points.len())
                .map(|i| {
                    let sum: f64 = curves.iter().map(|c| c.points[i].1).sum();
                    (first.points[i].0, sum / curves.len() as f64)
                })
                .collect(),
        })
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

/// One layer of a class as a worker measured it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassCosts {
    /// The class, as [`LayerTable`] names it.
    pub name: String,
    /// The model's first layer of the class.
    pub layer: CostCurve,
    /// That layer's weight bytes (every expert included).
    pub bytes: u64,
}

/// What the planner knows about one worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerCosts {
    /// The model's layer 0 (what every layer is scaled from when `classes` lacks its class).
    pub layer: CostCurve,
    /// Each layer class the worker timed on its own.
    pub classes: Vec<ClassCosts>,
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
    /// The mean of the costs of workers that are the same hardware (each curve averaged point
    /// by point, the bytes and budget of the first), or `None` when their profiles do not line
    /// up (other token counts or other layer classes).
    pub fn mean(group: &[&WorkerCosts]) -> Option<Self> {
        let first = *group.first()?;
        let curves = |pick: &dyn Fn(&WorkerCosts) -> &CostCurve| {
            CostCurve::mean(&group.iter().map(|w| pick(w)).collect::<Vec<_>>())
        };
        let same_classes = group.iter().all(|w| {
            w.classes
                .iter()
                .map(|c| &c.name)
                .eq(first.classes.iter().map(|c| &c.name))
        });
        if !same_classes {
            return None;
        }
        Some(Self {
            layer: curves(&|w| &w.layer)?,
            classes: (0..first.classes.len())
                .map(|i| {
                    Some(ClassCosts {
                        layer: curves(&|w| &w.classes[i].layer)?,
                        ..first.classes[i].clone()
                    })
                })
                .collect::<Option<_>>()?,
            embed: curves(&|w| &w.embed)?,
            head: curves(&|w| &w.head)?,
            ..first.clone()
        })
    }

    /// This worker's costs `factor` times slower in every part (what served batches measured
    /// against its profile).
    pub fn slowed(&self, factor: f64) -> Self {
        Self {
            layer: self.layer.slowed(factor),
            classes: self
                .classes
                .iter()
                .map(|c| ClassCosts {
                    layer: c.layer.slowed(factor),
                    ..c.clone()
                })
                .collect(),
            embed: self.embed.slowed(factor),
            head: self.head.slowed(factor),
            ..self.clone()
        }
    }
}

/// A class of layers in a [`LayerTable`].
#[derive(Debug, Clone, PartialEq)]
pub struct TableClass {
    /// As profiles name it (`linear_attention+moe`); a worker whose profile has no curve of
    /// this name is planned from its layer-0 curve.
    pub name: String,
    /// The model's first layer of the class against layer 0, by declared weights: its time
    /// (weights a position reads) and its weight bytes. What layer 0's curve and bytes are
    /// scaled by for a worker without this class's own.
    pub time: f64,
    pub bytes: f64,
}

/// One layer in a [`LayerTable`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TableLayer {
    /// Index into the table's classes.
    pub class: usize,
    /// Time and weight bytes against its class's first layer (1.0 for layers alike).
    pub time: f64,
    pub bytes: f64,
}

/// What the planner knows of a model's layers: which class each is (profiles time one layer
/// of each class) and how it weighs against that class's first layer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LayerTable {
    pub classes: Vec<TableClass>,
    pub layers: Vec<TableLayer>,
}

impl LayerTable {
    /// `n` layers alike, costed from each worker's layer-0 curve.
    pub fn uniform(n: usize) -> Self {
        Self::relative(&vec![1.0; n])
    }

    /// One unnamed class whose layers weigh `costs` against layer 0, in time and bytes alike.
    pub fn relative(costs: &[f64]) -> Self {
        Self {
            classes: vec![TableClass {
                name: String::new(),
                time: 1.0,
                bytes: 1.0,
            }],
            layers: costs
                .iter()
                .map(|&c| TableLayer {
                    class: 0,
                    time: c,
                    bytes: c,
                })
                .collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.layers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Each class's summed time and bytes over layers `0..l`, for every `l`: a stage's layers
    /// by class in O(classes).
    fn prefix(&self) -> Prefix {
        let k = self.classes.len();
        let mut time = vec![0.0; (self.layers.len() + 1) * k];
        let mut bytes = time.clone();
        for (l, layer) in self.layers.iter().enumerate() {
            for c in 0..k {
                time[(l + 1) * k + c] = time[l * k + c];
                bytes[(l + 1) * k + c] = bytes[l * k + c];
            }
            time[(l + 1) * k + layer.class] += layer.time;
            bytes[(l + 1) * k + layer.class] += layer.bytes;
        }
        Prefix {
            classes: k,
            time,
            bytes,
        }
    }
}

/// [`LayerTable::prefix`]: `time[l * classes + c]`, class `c`'s layers among `0..l`.
struct Prefix {
    classes: usize,
    time: Vec<f64>,
    bytes: Vec<f64>,
}

impl Prefix {
    /// Class `c`'s summed time and bytes over layers `a..b`.
    fn span(&self, c: usize, a: usize, b: usize) -> (f64, f64) {
        let (i, j) = (a * self.classes + c, b * self.classes + c);
        (self.time[j] - self.time[i], self.bytes[j] - self.bytes[i])
    }
}

/// A worker's cost of one layer of each class of a table: its own curve for the class, or its
/// layer-0 curve scaled by the class's declared weights.
struct ClassRates {
    /// Seconds of one such layer at the planned micro-batch, and its weight bytes.
    seconds: Vec<f64>,
    bytes: Vec<f64>,
}

impl ClassRates {
    fn new(w: &WorkerCosts, table: &LayerTable, tokens: usize) -> Self {
        let (seconds, bytes) = table
            .classes
            .iter()
            .map(
                |c| match w.classes.iter().find(|m| m.name == c.name && !c.name.is_empty()) {
                    Some(m) => (m.layer.at(tokens), m.bytes as f64),
                    None => (c.time * w.layer.at(tokens), c.bytes * w.layer_bytes as f64),
                },
            )
            .unzip();
        Self { seconds, bytes }
    }
}

/// Seconds of one layer of each class of `table` on worker `w` for a micro-batch of `tokens`
/// rows (the class's first layer), by class name (`layer` for an unnamed class): what a plan
/// costs the classes at.
pub fn class_seconds(w: &WorkerCosts, table: &LayerTable, tokens: usize) -> Vec<(String, f64)> {
    let rates = ClassRates::new(w, table, tokens);
    table
        .classes
        .iter()
        .zip(rates.seconds)
        .map(|(c, s)| {
            (
                if c.name.is_empty() {
                    "layer".to_string()
                } else {
                    c.name.clone()
                },
                s,
            )
        })
        .collect()
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

/// Seconds and weight bytes of stage `i` of `n` holding layers `a..b` on worker `w`, whose
/// cost per class is `rates`.
fn span_cost(
    w: &WorkerCosts,
    rates: &ClassRates,
    prefix: &Prefix,
    (i, n): (usize, usize),
    (a, b): (usize, usize),
    load: Workload,
) -> (f64, u64) {
    let (mut secs, mut layer_bytes) = (0.0, 0.0);
    for c in 0..prefix.classes {
        let (time, bytes) = prefix.span(c, a, b);
        secs += time * rates.seconds[c];
        layer_bytes += bytes * rates.bytes[c];
    }
    // Bytes come from the network: saturate rather than wrap past a budget (a float-to-integer
    // cast saturates too).
    let mut bytes = layer_bytes as u64;
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

/// Seconds and weight bytes of stage `i` of `n` holding `layers` of `table` (the part of them
/// the table has) on worker `w`, for a micro-batch of `load`.
pub fn stage_cost(
    w: &WorkerCosts,
    table: &LayerTable,
    (i, n): (usize, usize),
    layers: Range<usize>,
    load: Workload,
) -> (f64, u64) {
    let rates = ClassRates::new(w, table, load.tokens);
    let (a, b) = (layers.start.min(table.len()), layers.end.min(table.len()));
    span_cost(w, &rates, &table.prefix(), (i, n), (a, b.max(a)), load)
}

/// Contiguous layer ranges for `workers`, in order, that minimize the slowest stage's time for
/// micro-batches of `workload`, each stage's weights within its worker's budget; among equally
/// slow splits, the one with the least total time (latency). Exact: two dynamic programs over
/// (stage, layers so far), O(stages × layers²).
pub fn plan(num_layers: usize, workers: &[WorkerCosts], workload: Workload) -> Result<Plan, PlanError> {
    plan_layers(&LayerTable::uniform(num_layers), workers, workload)
}

/// [`plan`] for layers that differ: each layer costs what its class costs on each worker
/// (the worker's own curve for the class, or its layer-0 curve scaled by declared weights),
/// scaled by how it weighs against the class's first layer.
pub fn plan_layers(table: &LayerTable, workers: &[WorkerCosts], workload: Workload) -> Result<Plan, PlanError> {
    let num_layers = table.len();
    // Sums per class over layers 0..l (exact integers for a uniform model, so its plans are
    // what they were).
    let prefix = table.prefix();
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
    let rates: Vec<ClassRates> = workers
        .iter()
        .map(|w| ClassRates::new(w, table, batch.tokens))
        .collect();
    let span = |i: usize, a: usize, b: usize| span_cost(&workers[i], &rates[i], &prefix, (i, n), (a, b), batch);
    // cost(i, a, b): stage i holding layers a..b, or None when its weights do not fit.
    let cost = |i: usize, a: usize, b: usize| {
        let (secs, bytes) = span(i, a, b);
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
        .map(|(i, r)| span(i, r.start, r.end).0)
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

/// Each stage's predicted seconds for one micro-batch of `workload` when worker `i` holds
/// `ranges[i]`.
pub fn stage_times(
    table: &LayerTable,
    workers: &[WorkerCosts],
    ranges: &[Range<usize>],
    workload: Workload,
) -> Vec<f64> {
    let n = ranges.len();
    ranges
        .iter()
        .zip(workers)
        .enumerate()
        .map(|(i, (r, w))| stage_cost(w, table, (i, n), r.clone(), workload).0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker whose layer costs `layer` seconds per token, embedding `embed` and head `head`
    /// per token, with no memory limit.
    pub(super) fn linear(layer: f64, embed: f64, head: f64) -> WorkerCosts {
        let curve = |s: f64| CostCurve::new(vec![(1, s), (64, 64.0 * s)]).unwrap();
        WorkerCosts {
            layer: curve(layer),
            classes: Vec::new(),
            embed: curve(embed),
            head: curve(head),
            layer_bytes: 100,
            embed_bytes: 1000,
            head_bytes: 1000,
            weight_budget: None,
        }
    }

    /// Every split of `table` into `workers.len()` non-empty contiguous ranges: the least
    /// bottleneck, and the least total time among splits within it.
    fn exhaustive(table: &LayerTable, workers: &[WorkerCosts], batch: Workload) -> Option<(f64, f64)> {
        fn go(
            table: &LayerTable,
            workers: &[WorkerCosts],
            batch: Workload,
            i: usize,
            start: usize,
            acc: &mut Vec<(f64, f64)>,
            cur: (f64, f64),
        ) {
            let (n, layers) = (workers.len(), table.len());
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
                let (secs, bytes) = stage_cost(&workers[i], table, (i, n), start..end, batch);
                if workers[i].weight_budget.is_some_and(|b| bytes > b) {
                    continue;
                }
                go(table, workers, batch, i + 1, end, acc, (cur.0.max(secs), cur.1 + secs));
            }
        }
        let mut all = Vec::new();
        go(table, workers, batch, 0, 0, &mut all, (0.0, 0.0));
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
            // Half the cases: a hybrid of two classes, some workers with their own curve for
            // the second (the others scale layer 0's), layers weighing unlike within a class.
            let table = match case % 2 {
                0 => LayerTable::uniform(layers),
                _ => LayerTable {
                    classes: vec![
                        TableClass {
                            name: "linear_attention+moe".into(),
                            time: 1.0,
                            bytes: 1.0,
                        },
                        TableClass {
                            name: "attention+moe".into(),
                            time: 0.5 + next(),
                            bytes: 0.5 + next(),
                        },
                    ],
                    layers: (0..layers)
                        .map(|l| TableLayer {
                            class: usize::from(l % 3 == 2),
                            time: 0.5 + next(),
                            bytes: 0.5 + next(),
                        })
                        .collect(),
                },
            };
            let workers: Vec<WorkerCosts> = workers
                .into_iter()
                .map(|mut w| {
                    if case % 2 == 1 && next() < 0.5 {
                        w.classes.push(ClassCosts {
                            name: "attention+moe".into(),
                            layer: CostCurve::new(vec![(1, next()), (64, 64.0 * next())]).unwrap(),
                            bytes: (next() * 200.0) as u64,
                        });
                    }
                    w
                })
                .collect();
            let expected = exhaustive(&table, &workers, batch);
            match plan_layers(&table, &workers, batch) {
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
        let uniform = plan_layers(&LayerTable::uniform(6), &same, one).unwrap();
        assert_eq!(uniform, plan(6, &same, one).unwrap());
        assert_eq!(uniform.ranges, vec![0..3, 3..6]);
        // The last two layers weigh three times as much: an even split would be 3 against 7;
        // 1+1+1+1 against 3+3 is the best there is.
        let p = plan_layers(&LayerTable::relative(&[1.0, 1.0, 1.0, 1.0, 3.0, 3.0]), &same, one).unwrap();
        assert_eq!(p.ranges, vec![0..4, 4..6]);
        assert!((p.bottleneck() - 6.0).abs() < 1e-9, "{p:?}");
    }

    /// Qwen3-Next's pattern over `n` layers: three linear-attention layers, then one of full
    /// attention, every layer a mixture of experts.
    fn hybrid(n: usize, full_vs_linear: f64) -> LayerTable {
        let class = |name: &str, w: f64| TableClass {
            name: name.into(),
            time: w,
            bytes: w,
        };
        LayerTable {
            classes: vec![
                class("linear_attention+moe", 1.0),
                class("attention+moe", full_vs_linear),
            ],
            layers: (0..n)
                .map(|l| TableLayer {
                    class: usize::from(l % 4 == 3),
                    time: 1.0,
                    bytes: 1.0,
                })
                .collect(),
        }
    }

    #[test]
    fn mixed_layers_are_balanced_by_each_class_measured_cost() {
        let one = Workload { tokens: 1, sampled: 1 };
        // Declared weights make a full-attention layer cost what a linear one does, and so
        // does a worker that timed no class of its own: 16 layers split 8 / 8.
        let table = hybrid(16, 1.0);
        let plain = [linear(1.0, 0.0, 0.0), linear(1.0, 0.0, 0.0)];
        assert_eq!(plan_layers(&table, &plain, one).unwrap().ranges, vec![0..8, 8..16]);
        // Measured, a linear-attention layer costs 3 and a full-attention one 1 (a state per
        // sequence against a short K/V): the cut at 8 still halves the pattern, now at 20 a side.
        let timed = |linear_secs: f64, full_secs: f64| {
            let mut w = linear(1.0, 0.0, 0.0);
            let curve = |s: f64| CostCurve::new(vec![(1, s), (64, 64.0 * s)]).unwrap();
            w.classes = vec![
                ClassCosts {
                    name: "linear_attention+moe".into(),
                    layer: curve(linear_secs),
                    bytes: 100,
                },
                ClassCosts {
                    name: "attention+moe".into(),
                    layer: curve(full_secs),
                    bytes: 100,
                },
            ];
            w
        };
        let p = plan_layers(&table, &[timed(3.0, 1.0), timed(3.0, 1.0)], one).unwrap();
        // Layers 0..16 cost 3,3,3,1 ×4 = 40; the best cut leaves 20 a side: 0..8 holds 3,3,3,1,3,3,3,1.
        assert_eq!(p.ranges, vec![0..8, 8..16]);
        assert_eq!(p.stage_seconds, vec![20.0, 20.0]);
        // One worker is slow at linear attention only (a GPU without its kernel, say): it
        // gets the stage with fewer linear layers, where layer-0 scaling would not see it.
        let table = hybrid(12, 1.0);
        let p = plan_layers(&table, &[timed(1.0, 1.0), timed(4.0, 1.0)], one).unwrap();
        let linear_layers = |r: &Range<usize>| r.clone().filter(|l| l % 4 != 3).count();
        assert!(
            linear_layers(&p.ranges[1]) < linear_layers(&p.ranges[0]),
            "{:?} {:?}",
            p.ranges,
            p.stage_seconds
        );
        let blind = plan_layers(&table, &[linear(1.0, 0.0, 0.0), linear(1.0, 0.0, 0.0)], one).unwrap();
        assert_eq!(blind.ranges, vec![0..6, 6..12]);
        assert!(p.bottleneck() < stage_times(&table, &[timed(1.0, 1.0), timed(4.0, 1.0)], &blind.ranges, one)[1]);
    }

    #[test]
    fn memory_counts_every_expert_while_time_counts_the_active_ones() {
        let one = Workload { tokens: 1, sampled: 1 };
        // A mixture of experts reads 1/8 of its weights per position: its curve is cheap, its
        // bytes are all the experts'.
        let moe = |budget| {
            let mut w = linear(1.0, 0.0, 0.0);
            w.embed_bytes = 0;
            w.head_bytes = 0;
            w.classes = vec![ClassCosts {
                name: "attention+moe".into(),
                layer: CostCurve::new(vec![(1, 1.0)]).unwrap(),
                bytes: 800,
            }];
            w.weight_budget = Some(budget);
            w
        };
        let table = LayerTable {
            classes: vec![TableClass {
                name: "attention+moe".into(),
                time: 1.0,
                bytes: 8.0,
            }],
            layers: vec![
                TableLayer {
                    class: 0,
                    time: 1.0,
                    bytes: 1.0,
                };
                8
            ],
        };
        // 6 layers' experts fit the first worker, 2 the second: time alone would split 4 / 4.
        let p = plan_layers(&table, &[moe(6 * 800), moe(2 * 800)], one).unwrap();
        assert_eq!(p.ranges, vec![0..6, 6..8]);
        assert_eq!(stage_cost(&moe(0), &table, (0, 2), 0..6, one).1, 6 * 800);
        let e = plan_layers(&table, &[moe(3 * 800), moe(3 * 800)], one).unwrap_err();
        assert!(matches!(e, PlanError::DoesNotFit { .. }), "{e}");
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
}
