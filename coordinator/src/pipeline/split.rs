//! Choosing the pipeline's layer ranges: explicit cuts, an even split, or a plan from the
//! workers' measured costs (`Worker.Profile`, asked once per worker and kept across rebuilds).

use std::collections::HashMap;
use std::ops::Range;

use baton_shared::proto::{CostPoint, ProfileRequest, ProfileResponse};
use baton_worker::service::AuthedWorkerClient;

use super::PipelineConfig;
use crate::planner::{self, ClassCosts, CostCurve, Shape, ShapeFit, ShapedPlan, SplitPolicy, WorkerCosts, Workload};
use crate::registry::WorkerEntry;

/// Decode batch sizes each worker is profiled at.
pub const PROFILE_TOKENS: [u32; 7] = [1, 2, 4, 8, 16, 32, 64];
/// KV positions each profiled token attends over.
pub const PROFILE_CONTEXT: u32 = 128;
/// Milliseconds each point is timed for, back to back: long enough that a worker sharing its
/// core shows its sustained share rather than a burst (about 1 s per worker in all).
pub const PROFILE_MILLIS_PER_POINT: u32 = 40;

/// How the current ranges were chosen, for `/admin/cluster` and logs.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitInfo {
    /// `measured`, `even`, `cuts`, or `even` after a failed measurement (`note` says why).
    pub policy: &'static str,
    /// Each micro-batch shape planned for, on the chosen ranges: predicted seconds per stage
    /// and how far from its own best split (measured plans only).
    pub fits: Vec<ShapeFit>,
    /// Each stage worker's seconds for one layer of each class at the prompt chunk's size, by
    /// class name (measured plans only): what the plan balanced.
    pub class_seconds: Vec<Vec<(String, f64)>>,
    /// Why a measured plan was not used, when it was asked for.
    pub note: Option<String>,
}

/// Profiles kept across rebuilds, by worker id, address and registration: a worker that
/// registers again (restarted, maybe on other hardware under the same name) is measured again.
#[derive(Debug, Default)]
pub struct ProfileCache {
    by_worker: HashMap<(String, String, u64), WorkerCosts>,
}

fn profile_key(w: &WorkerEntry) -> (String, String, u64) {
    (w.id.clone(), w.address.clone(), w.seq)
}

impl ProfileCache {
    /// The cached costs of `workers`, in order, if every one has a profile.
    pub fn costs_for(&self, workers: &[WorkerEntry]) -> Option<Vec<WorkerCosts>> {
        workers
            .iter()
            .map(|w| self.by_worker.get(&profile_key(w)).cloned())
            .collect()
    }

    /// Scale each worker's cached costs by what serving measured (`scales[i]` for
    /// `workers[i]`), so the next plan is made for the speeds they have now.
    pub fn slow(&mut self, workers: &[WorkerEntry], scales: &[f64]) {
        for (w, &f) in workers.iter().zip(scales) {
            if let Some(c) = self.by_worker.get_mut(&profile_key(w)) {
                *c = c.slowed(f);
            }
        }
    }
}

/// The micro-batches a split is planned and judged for ([`planner::plan_shapes`]): a prompt
/// chunk (a micro-batch's share of the step's token budget, one row sampled, as the chunk that
/// ends a prompt), which the split is planned for, and a decode step (the running sequences'
/// tokens shared among the stages' micro-batches in flight, every row sampled), reported on it.
pub fn planning_shapes(config: &PipelineConfig) -> [Shape; 2] {
    let budget = config.micro_batch_tokens();
    let rows = config.max_running.div_ceil(config.stages.max(1)).clamp(1, budget);
    [
        Shape {
            name: "prompt_chunk",
            workload: Workload {
                tokens: budget,
                sampled: 1,
            },
        },
        Shape {
            name: "decode",
            workload: Workload {
                tokens: rows,
                sampled: rows,
            },
        },
    ]
}

fn curve(points: &[CostPoint], what: &str) -> Result<CostCurve, String> {
    CostCurve::new(points.iter().map(|p| (p.tokens as usize, p.seconds)).collect()).map_err(|e| format!("{what}: {e}"))
}

/// The planner's view of a worker from its profile.
fn worker_costs(w: &WorkerEntry, p: &ProfileResponse) -> Result<WorkerCosts, String> {
    // Unknown memory (0) sets no limit; the KV budget comes out of the rest.
    let budget = (w.memory_bytes > 0).then(|| w.memory_bytes.saturating_sub(w.kv_cache_bytes));
    costs_from_profile(p, budget)
}

/// A worker's costs from the profile it sent, with `weight_budget` bytes for weights (`None`:
/// no limit known); an error names the curve that cannot describe a cost.
pub fn costs_from_profile(p: &ProfileResponse, weight_budget: Option<u64>) -> Result<WorkerCosts, String> {
    Ok(WorkerCosts {
        layer: curve(&p.layer, "layer")?,
        classes: p
            .classes
            .iter()
            .map(|c| {
                Ok(ClassCosts {
                    name: c.class.clone(),
                    layer: curve(&c.layer, &c.class)?,
                    bytes: c.weight_bytes,
                })
            })
            .collect::<Result<_, String>>()?,
        embed: curve(&p.embed, "embed")?,
        head: curve(&p.head, "head")?,
        layer_bytes: p.layer_weight_bytes,
        embed_bytes: p.embed_weight_bytes,
        head_bytes: p.head_weight_bytes,
        weight_budget,
    })
}

/// How long a worker may take to answer Profile (loading a layer and the head, then timing).
const PROFILE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(120);

/// The planner's view of every worker, from cached profiles or asked for now, all at once.
/// Only valid answers are cached; an error names the first worker that failed.
pub(super) async fn profiles(
    config: &PipelineConfig,
    workers: &[WorkerEntry],
    clients: &[AuthedWorkerClient],
    cache: &mut ProfileCache,
) -> Result<Vec<WorkerCosts>, String> {
    let key = profile_key;
    let asks = workers
        .iter()
        .zip(clients)
        .filter(|(w, _)| !cache.by_worker.contains_key(&key(w)))
        .map(|(w, c)| {
            let mut client = c.clone();
            let req = ProfileRequest {
                model: config.model.clone(),
                weights: config.weights.clone(),
                token_counts: PROFILE_TOKENS.to_vec(),
                context: PROFILE_CONTEXT,
                reps: 3,
                min_millis: PROFILE_MILLIS_PER_POINT,
                kv_dtype: config.kv_dtype.to_string(),
            };
            async move {
                let started = std::time::Instant::now();
                let failed = |why: String| format!("worker {} ({}) could not be profiled: {why}", w.id, w.address);
                let r = tokio::time::timeout(PROFILE_DEADLINE, client.profile(req))
                    .await
                    .map_err(|_| failed(format!("no answer within {} s", PROFILE_DEADLINE.as_secs())))?
                    .map_err(|e| failed(e.message().to_string()))?;
                let costs = worker_costs(w, &r.into_inner()).map_err(|e| failed(format!("bad profile: {e}")))?;
                tracing::info!(worker_id = %w.id, seconds = started.elapsed().as_secs_f64(), "worker profiled");
                Ok::<_, String>((key(w), costs))
            }
        });
    let mut first_error = None;
    let mut fresh = Vec::new();
    for r in futures::future::join_all(asks).await {
        match r {
            Ok(answer) => fresh.push(answer),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    // Pooled as they are measured: what serving later measures of each worker
    // ([`ProfileCache::slow`]) stays its own.
    let profiled: Vec<WorkerEntry> = fresh
        .iter()
        .filter_map(|(k, _)| workers.iter().find(|w| key(w) == *k).cloned())
        .collect();
    let (keys, costs): (Vec<_>, Vec<_>) = fresh.into_iter().unzip();
    cache.by_worker.extend(keys.into_iter().zip(pooled(&profiled, costs)));
    // Only this build's workers stay: the others are gone or registered again.
    cache.by_worker.retain(|k, _| workers.iter().any(|w| key(w) == *k));
    if let Some(e) = first_error {
        return Err(e);
    }
    Ok(workers.iter().map(|w| cache.by_worker[&key(w)].clone()).collect())
}

/// What makes workers the same hardware: the same host, device kind, threads and features
/// (kernel path, GPU model). Workers on other hosts are never pooled, however alike.
fn hardware_key(w: &WorkerEntry) -> (&str, &str, u32, Vec<&str>) {
    let host = w.address.split("://").nth(1).unwrap_or(&w.address);
    let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
    let mut features: Vec<&str> = w.features.iter().map(String::as_str).collect();
    features.sort_unstable();
    (host, &w.device_kind, w.cores, features)
}

/// `costs` (one per worker of `workers`, profiled together) with each group of workers that
/// are the same hardware given the mean of the group's profiles. A profile is one short timing per worker, and on a busy or
/// virtual machine two identical workers can time 1.5× apart in it (measured: docs/benchmarks.md,
/// "Profiler and planner by layer class, measured"); the plan should not move with that noise.
fn pooled(workers: &[WorkerEntry], mut costs: Vec<WorkerCosts>) -> Vec<WorkerCosts> {
    let mut groups: HashMap<_, Vec<usize>> = HashMap::new();
    for (i, w) in workers.iter().enumerate() {
        groups.entry(hardware_key(w)).or_default().push(i);
    }
    for members in groups.values().filter(|m| m.len() > 1) {
        let group: Vec<&WorkerCosts> = members.iter().map(|&i| &costs[i]).collect();
        if let Some(mean) = WorkerCosts::mean(&group) {
            let times: Vec<f64> = group.iter().map(|c| c.layer.at(16)).collect();
            let spread = times.iter().copied().fold(0.0, f64::max) / times.iter().copied().fold(f64::MAX, f64::min);
            let ids: Vec<&str> = members.iter().map(|&i| workers[i].id.as_str()).collect();
            tracing::info!(workers = ?ids, spread_at_16_tokens = spread, "profiles of workers on the same hardware pooled");
            for &i in members {
                costs[i] = mean.clone();
            }
        }
    }
    costs
}

/// A plan from the workers' profiles.
async fn measured(
    config: &PipelineConfig,
    workers: &[WorkerEntry],
    clients: &[AuthedWorkerClient],
    cache: &mut ProfileCache,
) -> Result<(ShapedPlan, Vec<Vec<(String, f64)>>), String> {
    let costs = profiles(config, workers, clients, cache).await?;
    let table = config.planned_layers();
    let shapes = planning_shapes(config);
    let plan = planner::plan_shapes(&table, &costs, &shapes).map_err(|e| e.to_string())?;
    let classes = costs
        .iter()
        .map(|w| planner::class_seconds(w, &table, shapes[0].workload.tokens))
        .collect();
    Ok((plan, classes))
}

/// The layer ranges for `workers` (one stage each, in order) and how they were chosen.
pub async fn choose(
    config: &PipelineConfig,
    workers: &[WorkerEntry],
    clients: &[AuthedWorkerClient],
    cache: &mut ProfileCache,
) -> Result<(Vec<Range<usize>>, SplitInfo), String> {
    if let Some(cuts) = &config.cuts {
        return Ok((
            planner::ranges_from_cuts(config.num_layers, cuts)?,
            SplitInfo::unmeasured("cuts", None),
        ));
    }
    let even = || planner::even_split(config.num_layers, config.stages);
    if config.split == SplitPolicy::Even || config.stages == 1 {
        return Ok((even(), SplitInfo::unmeasured("even", None)));
    }
    match measured(config, workers, clients, cache).await {
        Ok((plan, class_seconds)) => {
            for fit in &plan.fits {
                tracing::info!(ranges = ?plan.ranges, shape = fit.shape.name, tokens = fit.shape.workload.tokens,
                    sampled = fit.shape.workload.sampled, predicted_seconds = ?fit.stage_seconds,
                    slowdown = fit.slowdown(), "measured split planned");
            }
            tracing::info!(class_seconds = ?class_seconds, "layer costs the split balanced");
            let info = SplitInfo {
                policy: "measured",
                fits: plan.fits,
                class_seconds,
                note: None,
            };
            Ok((plan.ranges, info))
        }
        Err(e) => {
            tracing::warn!("measured split unavailable, splitting evenly: {e}");
            Ok((even(), SplitInfo::unmeasured("even", Some(e))))
        }
    }
}

impl SplitInfo {
    /// Ranges chosen without a plan (`cuts` or `even`); `note` says why a measured plan was
    /// not used when one was asked for.
    pub fn unmeasured(policy: &'static str, note: Option<String>) -> Self {
        Self {
            policy,
            fits: Vec::new(),
            class_seconds: Vec::new(),
            note,
        }
    }

    /// Stage `i`'s predicted seconds for one micro-batch of each planned shape, by shape name.
    pub fn stage_seconds(&self, i: usize) -> Vec<(&'static str, f64)> {
        self.fits
            .iter()
            .filter_map(|f| Some((f.shape.name, *f.stage_seconds.get(i)?)))
            .collect()
    }

    /// The JSON `/admin/cluster` shows.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "policy": self.policy,
            // Each shape planned for: its micro-batch, each stage's predicted milliseconds, the
            // least slowest stage any split gives it, and how many times that it takes here.
            "shapes": self.fits.iter().map(|f| serde_json::json!({
                "shape": f.shape.name,
                "tokens": f.shape.workload.tokens,
                "sampled": f.shape.workload.sampled,
                "predicted_stage_ms": f.stage_seconds.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
                "best_ms": f.best * 1e3,
                "slowdown": f.slowdown(),
            })).collect::<Vec<_>>(),
            // Per stage worker: milliseconds of one layer of each class at the prompt chunk's size.
            "layer_class_ms": self.class_seconds.iter().map(|classes| {
                classes.iter().map(|(name, s)| (name.clone(), serde_json::json!(s * 1e3))).collect::<serde_json::Map<_, _>>()
            }).collect::<Vec<_>>(),
            "note": self.note,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(stages: usize, max_running: usize, budget: usize) -> PipelineConfig {
        PipelineConfig {
            model: String::new(),
            num_layers: 30,
            layer_table: Default::default(),
            vocab_size: 10,
            max_context: 100,
            eos_ids: vec![],
            stages,
            cuts: None,
            split: SplitPolicy::Measured,
            peer: baton_shared::auth::PeerAuth::plaintext(""),
            activation_dtype: baton_shared::proto::Dtype::F32,
            weights: "f32".into(),
            max_queue: 1,
            max_running,
            max_batch_tokens: budget,
            auto_limits: crate::pipeline::sizing::AutoLimits::NONE,
            kv_dim: 1,
            layer_caches: Vec::new(),
            kv_block_size: 16,
            kv_max_blocks: None,
            kv_dtype: baton_worker::kv_cache::KvDtype::F32,
            prefix_caching: true,
            state_snapshots: 0,
            recurrent_state: false,
            max_migrations: 3,
            queue_timeout: std::time::Duration::from_secs(60),
            live_replan: None,
            speculative: crate::speculative::SpeculativeConfig::OFF,
        }
    }

    fn worker(address: &str, cores: u32, kernels: &str) -> WorkerEntry {
        WorkerEntry {
            id: address.into(),
            address: address.into(),
            device_kind: "cpu".into(),
            cores,
            memory_bytes: 1 << 30,
            features: vec![format!("kernels:{kernels}"), "kv_dtype:f32,f16".into()],
            kv_cache_bytes: 0,
            metrics_address: String::new(),
            seq: 0,
            last_seen: std::time::Instant::now(),
        }
    }

    /// Costs whose every curve takes `ms` milliseconds per token at 1 and 8 tokens.
    fn costs(ms: f64) -> WorkerCosts {
        let curve = || CostCurve::new(vec![(1, ms / 1e3), (8, 8.0 * ms / 1e3)]).unwrap();
        WorkerCosts {
            layer: curve(),
            classes: vec![ClassCosts {
                name: "linear_attention+dense".into(),
                layer: curve(),
                bytes: 10,
            }],
            embed: curve(),
            head: curve(),
            layer_bytes: 10,
            embed_bytes: 1,
            head_bytes: 1,
            weight_budget: None,
        }
    }

    #[test]
    fn workers_that_are_the_same_hardware_are_planned_from_their_mean_profile() {
        let workers = [
            worker("http://127.0.0.1:7001", 1, "avx512-vnni"),
            worker("http://127.0.0.1:7002", 1, "avx512-vnni"),
            // Other threads, another host, another kernel path: their own profiles.
            worker("http://127.0.0.1:7003", 2, "avx512-vnni"),
            worker("http://10.0.0.2:7001", 1, "avx512-vnni"),
            worker("http://127.0.0.1:7004", 1, "avx2"),
        ];
        let got = pooled(&workers, [2.0, 4.0, 5.0, 6.0, 7.0].map(costs).to_vec());
        let at_8 = |c: &WorkerCosts| (c.layer.at(8) * 1e3, c.classes[0].layer.at(8) * 1e3, c.head.at(1) * 1e3);
        for (i, want) in [(0, 3.0), (1, 3.0), (2, 5.0), (3, 6.0), (4, 7.0)] {
            let (layer, class, head) = at_8(&got[i]);
            assert!((layer - 8.0 * want).abs() < 1e-9, "worker {i}: {layer}");
            assert!(
                (class - 8.0 * want).abs() < 1e-9 && (head - want).abs() < 1e-9,
                "worker {i}"
            );
        }
        // Profiles that do not line up are left as measured.
        let mut other_grid = costs(4.0);
        other_grid.layer = CostCurve::new(vec![(1, 0.004), (16, 0.064)]).unwrap();
        let got = pooled(&workers[..2], vec![costs(2.0), other_grid]);
        assert_eq!(got[0].layer.at(8), costs(2.0).layer.at(8));
    }

    #[test]
    fn splits_are_planned_for_a_prompt_chunk_and_a_decode_step() {
        let w = |tokens, sampled| Workload { tokens, sampled };
        let shapes = |c: &PipelineConfig| planning_shapes(c).map(|s| (s.name, s.workload));
        // Two stages, 16 running, 128 tokens a step: 64-token chunks, 8 decode rows a micro-batch.
        assert_eq!(
            shapes(&config(2, 16, 128)),
            [("prompt_chunk", w(64, 1)), ("decode", w(8, 8))]
        );
        assert_eq!(
            shapes(&config(1, 16, 128)),
            [("prompt_chunk", w(128, 1)), ("decode", w(16, 16))]
        );
        // Decode rows fit a micro-batch's budget; small budgets still plan at least one row.
        assert_eq!(shapes(&config(2, 300, 128))[1], ("decode", w(64, 64)));
        assert_eq!(
            shapes(&config(3, 1, 1)),
            [("prompt_chunk", w(1, 1)), ("decode", w(1, 1))]
        );
    }
}
