//! Live re-planning: while a measured split serves, each stage's forward time over served
//! micro-batches (measured by its worker, read from Health) is compared with the plan. When a
//! new plan for the speeds measured would make the slowest stage at least `threshold` times
//! faster, for `windows` windows in a row, the new ranges are loaded beside the served stages
//! and a planned switch is due: the engine drains, the supervisor activates them (or builds
//! the new split when they could not be loaded) and scales the workers' profiles by what was
//! measured, and the sequences move to it.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_shared::proto::HealthRequest;
use baton_worker::service::AuthedWorkerClient;

use super::supervisor::{self, Pipeline, StageAssignment};
use super::{PipelineConfig, PipelineStatus};
use crate::planner::{self, LayerTable, WorkerCosts, Workload};
use crate::registry::WorkerEntry;

/// When stage times drifting from the plan trigger a new split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplanPolicy {
    /// Re-plan when the current split's slowest stage is at least this many times a new
    /// plan's (1.15: 15% slower than it could be).
    pub threshold: f64,
    /// Length of one measurement window.
    pub window: Duration,
    /// Windows in a row the drift must hold (so a burst does not move layers).
    pub windows: u32,
    /// Nothing is measured this long after a pipeline is built (warm-up, and at most one
    /// re-plan per this much time).
    pub settle: Duration,
    /// Micro-batches every stage must have run in a window for it to count.
    pub min_batches: u64,
}

impl Default for ReplanPolicy {
    /// 15% over 3 windows of 2 s, 10 s after a build, at least 8 micro-batches a window.
    fn default() -> Self {
        Self {
            threshold: 1.15,
            window: Duration::from_secs(2),
            windows: 3,
            settle: Duration::from_secs(10),
            min_batches: 8,
        }
    }
}

/// What the watch compares: the plan the pipeline was built from.
pub(crate) struct PlanInputs {
    pub layers: LayerTable,
    /// The stage workers' costs the plan was made from (their cached profiles).
    pub costs: Vec<WorkerCosts>,
    pub ranges: Vec<Range<usize>>,
    /// The micro-batch shapes the split is planned for (a new plan is for them too).
    pub shapes: Vec<planner::Shape>,
}

/// A re-plan the watch found due.
#[derive(Debug, Clone)]
pub(crate) struct Due {
    pub reason: String,
    /// Each stage worker's speed against its profile, relative to the least slowed.
    pub scales: Vec<f64>,
    /// The new ranges, already loaded beside the served stages on every worker (None: they
    /// could not be, so the switch rebuilds).
    pub staged: Option<Staged>,
}

/// New ranges every worker holds beside the stage it serves, ready for ActivateStage: the
/// pipeline's stages with the plan's ranges.
#[derive(Debug, Clone)]
pub(crate) struct Staged {
    pub stages: Vec<(StageAssignment, AuthedWorkerClient)>,
    pub kv_blocks: usize,
    pub plan: planner::ShapedPlan,
}

/// What loading new ranges beside the served stages needs.
pub(crate) struct Staging {
    pub config: PipelineConfig,
    pub workers: Vec<WorkerEntry>,
}

/// Load `plan`'s ranges on every stage's worker beside the stage it serves (in parallel).
async fn stage_beside(
    stages: &[(StageAssignment, AuthedWorkerClient)],
    staging: &Staging,
    plan: &planner::ShapedPlan,
) -> Result<Staged, String> {
    let config = &staging.config;
    let kv_blocks = supervisor::kv_blocks(config, &staging.workers, &plan.ranges).map_err(|e| e.message)?;
    let stages: Vec<_> = stages
        .iter()
        .zip(&plan.ranges)
        .map(|((a, c), r)| {
            let a = StageAssignment {
                layers: r.clone(),
                ..a.clone()
            };
            (a, c.clone())
        })
        .collect();
    supervisor::load_stages(config, &stages, kv_blocks, true)
        .await
        .map_err(|e| e.message)?;
    Ok(Staged {
        stages,
        kv_blocks,
        plan: plan.clone(),
    })
}

/// Where a due re-plan is left for the executor (checked every engine step) and the
/// supervisor (which applies the scales).
pub(crate) type DueSlot = Arc<Mutex<Option<Due>>>;

/// Watches one pipeline's stage times until dropped.
pub(crate) struct DriftWatch {
    pub due: DueSlot,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for DriftWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Forward totals of one stage at one moment.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    batches: u64,
    tokens: u64,
    seconds: f64,
}

/// Start watching `pipeline`'s stages against `plan`; `status` counts the tokens sampled and
/// micro-batches returned (the served batches' sampled rows).
pub(crate) fn watch(
    pipeline: &Pipeline,
    plan: PlanInputs,
    policy: ReplanPolicy,
    status: Arc<PipelineStatus>,
    staging: Staging,
) -> DriftWatch {
    let due: DueSlot = Arc::new(Mutex::new(None));
    let stages = pipeline.stages.clone();
    let slot = due.clone();
    let task = tokio::spawn(async move {
        tokio::time::sleep(policy.settle).await;
        let mut before: Option<(Vec<Totals>, (u64, u64))> = None;
        let mut streak = 0;
        let mut tick = tokio::time::interval(policy.window);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let answers = futures::future::join_all(stages.iter().map(|(_, c)| {
                let mut c = c.clone();
                async move {
                    let h = tokio::time::timeout(Duration::from_secs(2), c.health(HealthRequest {})).await;
                    let h = h.ok()?.ok()?.into_inner();
                    Some(Totals {
                        batches: h.forward_batches,
                        tokens: h.forward_tokens,
                        seconds: h.forward_seconds,
                    })
                }
            }))
            .await;
            // A stage that does not answer is the failure path's business.
            let Some(now) = answers.into_iter().collect::<Option<Vec<Totals>>>() else {
                before = None;
                streak = 0;
                continue;
            };
            let served = (
                status.generated_tokens.load(Ordering::Relaxed),
                status.steps_completed.load(Ordering::Relaxed),
            );
            let Some((prev, prev_served)) = before.replace((now.clone(), served)) else {
                continue;
            };
            let window: Vec<Totals> = now
                .iter()
                .zip(&prev)
                .map(|(n, p)| Totals {
                    batches: n.batches.saturating_sub(p.batches),
                    tokens: n.tokens.saturating_sub(p.tokens),
                    seconds: n.seconds - p.seconds,
                })
                .collect();
            if window.iter().any(|w| w.batches < policy.min_batches) {
                streak = 0;
                continue;
            }
            let measured: Vec<f64> = window.iter().map(|w| w.seconds / w.batches as f64).collect();
            // The served batches' mean shape: rows through the layers (stage 0's count) and
            // rows sampled by the head (tokens generated per returned micro-batch).
            let steps = served.1.saturating_sub(prev_served.1).max(1);
            let workload = Workload {
                tokens: (window[0].tokens as f64 / window[0].batches as f64).round().max(1.0) as usize,
                sampled: (served.0.saturating_sub(prev_served.0) as f64 / steps as f64)
                    .round()
                    .max(1.0) as usize,
            };
            for (i, m) in measured.iter().enumerate() {
                metrics::gauge!("baton_stage_measured_seconds", "stage" => i.to_string()).set(*m);
            }
            let found = planner::drift(
                &plan.layers,
                &plan.costs,
                &plan.ranges,
                &measured,
                workload,
                &plan.shapes,
                policy.threshold,
            );
            let Some(d) = found else {
                streak = 0;
                continue;
            };
            streak += 1;
            tracing::info!(streak, scales = ?d.scales, current = ?plan.ranges, better = ?d.better.ranges,
                "stage times drift from the plan");
            if streak < policy.windows {
                continue;
            }
            let ms = |v: &[f64]| {
                v.iter()
                    .map(|s| format!("{:.2}", s * 1e3))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let reason = format!(
                "stage times [{}] ms per micro-batch of {} rows ({} sampled) against [{}] ms from the profiles: \
                 worker speeds x[{}] of their profiles; ranges {:?} would bring the planned prompt chunk's slowest stage from {:.2}x its best split's to {:.2}x",
                ms(&measured),
                workload.tokens,
                workload.sampled,
                ms(&d.predicted),
                d.scales
                    .iter()
                    .map(|s| format!("{s:.2}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                d.better.ranges,
                d.current,
                d.better.slowdown(),
            );
            // The new ranges load while the old pipeline serves; then the switch is a drain and
            // an activation, not a reload. Without the memory for both, it rebuilds.
            let staged = match stage_beside(&stages, &staging, &d.better).await {
                Ok(staged) => Some(staged),
                Err(e) => {
                    tracing::warn!("could not load the new ranges beside the served stages ({e}); rebuilding instead");
                    None
                }
            };
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(Due {
                staged,
                reason,
                scales: d.scales,
            });
            return;
        }
    });
    DriftWatch { due, task }
}
