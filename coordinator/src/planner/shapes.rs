//! Splits for the two kinds of micro-batch a pipeline serves, and re-planning when workers drift.
//!
//! Prompt chunks send every row through every layer and at most one through the head; decode
//! steps send every row through the head. A split balanced for one is not balanced for the
//! other, since only decode weighs the head on the last stage, so the planner must choose whose
//! bottleneck it minimizes. It chooses the prompt chunk's, and reports the decode step's on the
//! same split (`/admin/cluster` `split.shapes`):
//!
//! * A prompt's chunks follow each other through the stages, each stage busy as long as the
//!   slowest one (the chunk size keeps per-micro-batch overheads under a tenth of a stage's
//!   time), so its first token waits on the slowest stage for every chunk.
//! * A sequence's next decode token waits for its last one to come back, so a decode
//!   micro-batch's round trip is the sum of its stage times plus the hops and the coordinator's
//!   work, which no split changes; the slowest stage shows only where it exceeds its share of
//!   that round trip.
//!
//! Measured with SmolLM2 over two one-core workers on 2-vCPU VMs (docs/benchmarks.md): the
//! split planned for decode rows (17/13, fewer layers beside the head) served 16 streams no
//! faster than 15/15 (0.97× and 1.00× in two sessions), while it made a lone 1,060-token
//! prompt's first token 12% later. Where decode is bound by its slowest stage instead (large
//! stages, fast links, cores to spare), planning for prompt chunks costs decode up to the
//! head's share of the last stage, less what the round trip hides: an 8 B model's head weighs
//! about 2.4 of its 32 layers, so the last of two stages does about 15% more per decode step.
//! The admin view shows that cost as the decode shape's `slowdown`.

use std::ops::Range;

use super::{LayerTable, PlanError, WorkerCosts, Workload, plan_layers, stage_times};

/// A kind of micro-batch a split must serve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// `prompt_chunk` or `decode`, for logs, metrics and the admin view.
    pub name: &'static str,
    pub workload: Workload,
}

/// How one shape fares on a split.
#[derive(Debug, Clone, PartialEq)]
pub struct ShapeFit {
    pub shape: Shape,
    /// Predicted seconds of each stage for one micro-batch of the shape.
    pub stage_seconds: Vec<f64>,
    /// The least slowest-stage seconds any split reaches for this shape alone.
    pub best: f64,
}

impl ShapeFit {
    /// The slowest stage's seconds for this shape.
    pub fn bottleneck(&self) -> f64 {
        self.stage_seconds.iter().copied().fold(0.0, f64::max)
    }

    /// How many times its own best split's time this shape takes here (1.0: as fast).
    pub fn slowdown(&self) -> f64 {
        slowdown(self.bottleneck(), self.best)
    }
}

/// `seconds` over `best`, where a best of nothing (every stage free) is matched by anything.
fn slowdown(seconds: f64, best: f64) -> f64 {
    if best > 0.0 { seconds / best } else { 1.0 }
}

/// A split planned for the first of several shapes, and how each fares on it.
#[derive(Debug, Clone, PartialEq)]
pub struct ShapedPlan {
    pub ranges: Vec<Range<usize>>,
    /// Each shape on these ranges, in the order asked (the first is the one planned for).
    pub fits: Vec<ShapeFit>,
}

impl ShapedPlan {
    /// The planned shape's slowdown against its own best split (1.0 unless memory forbids it).
    pub fn slowdown(&self) -> f64 {
        self.fits.first().map_or(1.0, ShapeFit::slowdown)
    }
}

/// The split that makes `shapes[0]`'s slowest stage fastest ([`plan_layers`], each stage's
/// weights within its worker's budget), with how every shape fares on it.
pub fn plan_shapes(table: &LayerTable, workers: &[WorkerCosts], shapes: &[Shape]) -> Result<ShapedPlan, PlanError> {
    let lead = shapes
        .first()
        .ok_or_else(|| PlanError::Costs("no micro-batch shape to plan for".into()))?;
    let plan = plan_layers(table, workers, lead.workload)?;
    // The lead shape's own best split is this plan: no second dynamic program for it.
    let best = plan.bottleneck();
    let mut fits = vec![ShapeFit {
        shape: *lead,
        stage_seconds: plan.stage_seconds,
        best,
    }];
    fits.extend(shape_fits(table, workers, &plan.ranges, &shapes[1..])?);
    Ok(ShapedPlan {
        ranges: plan.ranges,
        fits,
    })
}

/// How each of `shapes` fares when worker `i` holds `ranges[i]` (its best from a plan for it
/// alone).
pub fn shape_fits(
    table: &LayerTable,
    workers: &[WorkerCosts],
    ranges: &[Range<usize>],
    shapes: &[Shape],
) -> Result<Vec<ShapeFit>, PlanError> {
    shapes
        .iter()
        .map(|&shape| {
            Ok(ShapeFit {
                shape,
                stage_seconds: stage_times(table, workers, ranges, shape.workload),
                best: plan_layers(table, workers, shape.workload)?.bottleneck(),
            })
        })
        .collect()
}

/// A better split for workers whose speed drifted from their profiles.
#[derive(Debug, Clone, PartialEq)]
pub struct Drift {
    /// Each stage's worker speed against its profile, relative to the least slowed worker
    /// (1.0 for it; 2.0: half as fast as profiled, relative to the others).
    pub scales: Vec<f64>,
    /// Each stage's predicted seconds at the served workload, from the profiles.
    pub predicted: Vec<f64>,
    /// The current split's slowdown for the planned shape under those speeds.
    pub current: f64,
    /// The plan for those speeds; its slowdown is at least `threshold` times less.
    pub better: ShapedPlan,
}

/// Whether the current split should change, from `measured[i]`, stage `i`'s mean forward
/// seconds over the micro-batches served, whose mean shape was `served` (every stage runs the
/// same batches). Each stage is predicted at that shape from `costs`, each worker's costs are
/// scaled by its measured ÷ predicted ratio, and a new plan for `shapes` is made; it is returned
/// when the current split's slowdown for the planned shape is at least `threshold` times the
/// new plan's and the ranges differ. A change of traffic alone moves nothing: the plan is for
/// `shapes`, not for what was served.
pub fn drift(
    table: &LayerTable,
    costs: &[WorkerCosts],
    current: &[Range<usize>],
    measured: &[f64],
    served: Workload,
    shapes: &[Shape],
    threshold: f64,
) -> Option<Drift> {
    let n = costs.len();
    if n < 2 || current.len() != n || measured.len() != n {
        return None;
    }
    let predicted = stage_times(table, costs, current, served);
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
    let better = plan_shapes(table, &slowed, shapes).ok()?;
    let lead = better.fits.first()?;
    let on_current = ShapeFit {
        stage_seconds: stage_times(table, &slowed, current, lead.shape.workload),
        ..lead.clone()
    };
    let current_slowdown = on_current.slowdown();
    (better.ranges != current && current_slowdown >= threshold * better.slowdown()).then_some(Drift {
        scales,
        predicted,
        current: current_slowdown,
        better,
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::linear;
    use super::*;

    fn shape(name: &'static str, tokens: usize, sampled: usize) -> Shape {
        Shape {
            name,
            workload: Workload { tokens, sampled },
        }
    }

    #[test]
    fn the_split_is_planned_for_prompt_chunks_and_reports_decode_steps() {
        // Layers cost per row; the head costs as much per sampled row as four layers.
        let workers = [linear(1e-3, 1e-5, 4e-3), linear(1e-3, 1e-5, 4e-3)];
        let table = LayerTable::uniform(30);
        let chunk = shape("prompt_chunk", 64, 1);
        let decode = shape("decode", 8, 8);
        let alone = |s: Shape| plan_layers(&table, &workers, s.workload).unwrap();
        // Alone, a prompt chunk wants an even split and a decode step moves layers off the head's stage.
        assert_eq!(alone(chunk).ranges, [0..15, 15..30]);
        assert_eq!(alone(decode).ranges, [0..17, 17..30]);
        let plan = plan_shapes(&table, &workers, &[chunk, decode]).unwrap();
        assert_eq!(plan.ranges, alone(chunk).ranges);
        assert_eq!(plan.slowdown(), 1.0);
        // Each shape's times on the split, against the best it gets on a split of its own.
        assert_eq!(plan.fits.len(), 2);
        assert_eq!(plan.fits[0].shape, chunk);
        assert_eq!(plan.fits[0].stage_seconds, alone(chunk).stage_seconds);
        assert_eq!(
            plan.fits[1].stage_seconds,
            stage_times(&table, &workers, &plan.ranges, decode.workload)
        );
        assert_eq!(plan.fits[1].best, alone(decode).bottleneck());
        // Decode: stage 1 holds 15 layers of 8 ms and the head's 32 ms (its own best split: 0.136 s).
        let d = &plan.fits[1];
        assert!((d.bottleneck() - (15.0 * 8e-3 + 32e-3)).abs() < 1e-12, "{d:?}");
        assert!((d.slowdown() - d.bottleneck() / alone(decode).bottleneck()).abs() < 1e-12);
        assert!(d.slowdown() > 1.1, "{d:?}");
        assert_eq!(
            shape_fits(&table, &workers, &plan.ranges, &[chunk, decode]).unwrap(),
            plan.fits
        );
    }

    #[test]
    fn nothing_to_plan_for_and_memory_that_fits_nothing_are_errors() {
        let table = LayerTable::uniform(4);
        let workers = [linear(1e-3, 1e-5, 4e-3), linear(1e-3, 1e-5, 4e-3)];
        assert!(matches!(plan_shapes(&table, &workers, &[]), Err(PlanError::Costs(_))));
        let mut tight = workers.clone();
        tight[1].weight_budget = Some(10);
        assert!(matches!(
            plan_shapes(&table, &tight, &[shape("decode", 4, 4)]),
            Err(PlanError::DoesNotFit { .. })
        ));
        assert!(matches!(
            plan_shapes(&LayerTable::uniform(1), &workers, &[shape("decode", 4, 4)]),
            Err(PlanError::Shape { .. })
        ));
    }

    #[test]
    fn a_worker_slowed_against_its_profile_gets_fewer_layers() {
        let workers = [linear(1e-3, 1e-4, 2e-3), linear(1e-3, 1e-4, 2e-3)];
        let load = Workload { tokens: 8, sampled: 4 };
        let shapes = [shape("prompt_chunk", 32, 1), shape("decode", 4, 4)];
        let costs = LayerTable::uniform(30);
        let plan = plan_shapes(&costs, &workers, &shapes).unwrap();
        let at_load = stage_times(&costs, &workers, &plan.ranges, load);
        let drifted = |measured: &[f64], load| drift(&costs, &workers, &plan.ranges, measured, load, &shapes, 1.15);
        // Served batches took what the profile says (at whatever speed): nothing to change.
        let half: Vec<f64> = at_load.iter().map(|s| s * 0.5).collect();
        assert_eq!(drifted(&half, load), None);
        // Decode-only traffic weighs the head more than the planned shapes' mix, but stage times
        // that match the profiles at that workload are no drift: the plan is for both shapes.
        for served in [Workload { tokens: 4, sampled: 4 }, Workload { tokens: 64, sampled: 1 }] {
            let times = stage_times(&costs, &workers, &plan.ranges, served);
            assert_eq!(drifted(&times, served), None, "{served:?}");
        }
        // The second worker now takes twice as long as profiled (relative to the first).
        let slowed = [at_load[0] * 0.5, at_load[1]];
        let d = drifted(&slowed, load).unwrap();
        assert_eq!(d.scales, [1.0, 2.0]);
        assert_eq!(d.predicted, at_load);
        assert!(d.better.ranges[1].len() < plan.ranges[1].len(), "{:?}", d.better.ranges);
        assert!(d.current >= 1.15 * d.better.slowdown());
        // The same plan made from the slowed costs directly.
        let direct = plan_shapes(&costs, &[workers[0].clone(), workers[1].slowed(2.0)], &shapes).unwrap();
        assert_eq!(d.better, direct);
        // A drift smaller than the threshold is left alone (hysteresis against noise).
        let slight = [at_load[0], at_load[1] * 1.05];
        assert_eq!(drifted(&slight, load), None);
        // Nonsense measurements change nothing.
        assert_eq!(drifted(&[0.0, at_load[1]], load), None);
    }
}
