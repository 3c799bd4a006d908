//! Per-stage load for `/admin/cluster` (and so the dashboard): every stage's Health answer
//! (sequences, KV positions, forward totals), polled while the pipeline stands and someone has
//! looked recently. Workers measure their own forward time; the coordinator only sees whole
//! round trips.

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_shared::proto::{HealthRequest, HealthResponse};
use serde_json::{Value, json};

use super::PipelineStatus;
use super::supervisor::Pipeline;

/// How often stages are asked: twice per dashboard refresh, so its deltas are recent.
const POLL_EVERY: Duration = Duration::from_millis(500);

/// A stage that has not answered in this long is reported as unreachable.
const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// Polling stops this long after the last `/admin/cluster` view: Health waits for the stage's
/// current micro-batch, so nobody watching should not cost the workers anything.
const VIEWED_WITHIN: Duration = Duration::from_secs(10);

/// What is known about one stage from polling it.
#[derive(Debug, Clone)]
pub struct StageLive {
    /// The latest answer; kept across failed polls so counters do not vanish.
    pub health: Option<HealthResponse>,
    /// When `health` was received.
    pub answered: Option<Instant>,
    /// Why the latest poll failed, if it did.
    pub error: Option<String>,
}

impl StageLive {
    /// The JSON shape `/admin/cluster` reports under each stage's `live`.
    pub fn to_json(&self) -> Value {
        let h = self.health.clone().unwrap_or_default();
        json!({
            "answered": self.health.is_some(),
            "answered_ms_ago": self.answered.map(|t| t.elapsed().as_millis() as u64),
            "error": self.error,
            "loaded": h.loaded,
            "sequences": h.active_sequences,
            "kv_tokens": h.kv_tokens,
            "kv_capacity_tokens": h.kv_capacity_tokens,
            "kv_bytes": h.kv_bytes,
            "kv_blocks_used": h.kv_blocks_used,
            "kv_blocks_total": h.kv_blocks_total,
            "state_slots_used": h.state_slots_used,
            "state_slots_total": h.state_slots_total,
            "state_snapshots_total": h.state_snapshots_total,
            "forward_batches": h.forward_batches,
            "forward_tokens": h.forward_tokens,
            "forward_seconds": h.forward_seconds,
        })
    }
}

/// Polls the stages until dropped; then their numbers are no longer live and are cleared.
pub(crate) struct Poller {
    task: tokio::task::JoinHandle<()>,
    status: Arc<PipelineStatus>,
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.task.abort();
        status_lock(&self.status).clear();
    }
}

fn status_lock(status: &PipelineStatus) -> std::sync::MutexGuard<'_, Vec<StageLive>> {
    status.stage_live.lock().unwrap_or_else(|e| e.into_inner())
}

/// Start polling `pipeline`'s stages into `status.stage_live`.
pub(crate) fn start(pipeline: &Pipeline, status: &Arc<PipelineStatus>) -> Poller {
    let clients: Vec<_> = pipeline.stages.iter().map(|(_, c)| c.clone()).collect();
    let empty = StageLive {
        health: None,
        answered: None,
        error: None,
    };
    *status_lock(status) = vec![empty; clients.len()];
    let shared = status.clone();
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(POLL_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let viewed = *shared.viewed.lock().unwrap_or_else(|e| e.into_inner());
            if viewed.is_none_or(|t| t.elapsed() >= VIEWED_WITHIN) {
                continue;
            }
            let answers = futures::future::join_all(clients.iter().map(|c| {
                let mut c = c.clone();
                async move {
                    match tokio::time::timeout(ANSWER_WITHIN, c.health(HealthRequest {})).await {
                        Ok(Ok(r)) => Ok(r.into_inner()),
                        Ok(Err(e)) => Err(e.message().to_string()),
                        Err(_) => Err(format!("no Health answer within {ANSWER_WITHIN:?}")),
                    }
                }
            }))
            .await;
            let now = Instant::now();
            let mut live = status_lock(&shared);
            for (slot, answer) in live.iter_mut().zip(answers) {
                match answer {
                    Ok(h) => {
                        slot.health = Some(h);
                        slot.answered = Some(now);
                        slot.error = None;
                    }
                    Err(e) => slot.error = Some(e),
                }
            }
        }
    });
    Poller {
        task,
        status: status.clone(),
    }
}
