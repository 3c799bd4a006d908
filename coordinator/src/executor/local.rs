//! The executor over one stage in this process (`baton serve --workers 0`, `baton generate`):
//! the whole model's [`Stage`] on its own OS thread, fed micro-batches through a channel, so
//! the async runtime never waits on compute and the engine is the same as for workers.

use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::Instant;

use baton_shared::proto::{BatchResult, MicroBatch};
use baton_worker::stage::{Stage, StageOutput, forward_span};
use tokio::sync::mpsc;

use super::{Executor, StageFailure};
use crate::pipeline::{PipelineStatus, StageLive};

/// What the stage thread is asked to do, in order.
enum Command {
    Run(MicroBatch),
    Free(Vec<u64>),
}

/// A full-model stage on a thread of its own.
pub(crate) struct LocalExecutor {
    commands: std_mpsc::Sender<Command>,
    results: mpsc::UnboundedReceiver<BatchResult>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The worker id the in-process stage reports in spans and `/admin/cluster`.
pub(crate) const LOCAL_WORKER: &str = "local";

impl LocalExecutor {
    /// Start the thread that owns `stage`; its load numbers go to `status.stage_live[0]`
    /// after every micro-batch, as a worker's Health answers do for a pipeline.
    pub fn start(stage: Stage, status: Arc<PipelineStatus>) -> Result<Self, StageFailure> {
        let (commands, command_rx) = std_mpsc::channel();
        let (result_tx, results) = mpsc::unbounded_channel();
        let thread = std::thread::Builder::new()
            .name("baton-local-stage".into())
            .spawn(move || serve(stage, command_rx, result_tx, &status))
            .map_err(|e| StageFailure::new(format!("starting the in-process stage thread: {e}")))?;
        Ok(Self {
            commands,
            results,
            thread: Some(thread),
        })
    }
}

/// The stage thread: run commands until the executor is dropped (or the loop stops reading).
fn serve(
    mut stage: Stage,
    commands: std_mpsc::Receiver<Command>,
    results: mpsc::UnboundedSender<BatchResult>,
    status: &PipelineStatus,
) {
    publish(&stage, status);
    while let Ok(command) = commands.recv() {
        match command {
            Command::Run(batch) => {
                let batch_id = batch.batch_id;
                let span = forward_span(LOCAL_WORKER, &batch);
                // A panic in the stage fails its micro-batch (the scheduler frees its sequences)
                // instead of every request and a reload of the whole model.
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| stage.run_observed(batch, &span)));
                let result = match run.unwrap_or_else(|p| Err(format!("the stage panicked: {}", panic_text(&p)))) {
                    Ok(StageOutput::Sampled(r)) => r,
                    Ok(StageOutput::Forward(_)) => BatchResult {
                        batch_id,
                        results: Vec::new(),
                        error: "the in-process stage does not hold the whole model".into(),
                    },
                    Err(error) => BatchResult {
                        batch_id,
                        results: Vec::new(),
                        error,
                    },
                };
                publish(&stage, status);
                if results.send(result).is_err() {
                    return;
                }
            }
            Command::Free(ids) => {
                stage.free(&ids);
                stage.record_usage();
                publish(&stage, status);
            }
        }
    }
}

/// A panic's message, where it has one.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("no message")
}

/// The stage's load numbers, where `/admin/cluster` reads them. Written in place: this runs
/// after every micro-batch, so it allocates nothing once the slot exists.
fn publish(stage: &Stage, status: &PipelineStatus) {
    let live = StageLive {
        health: Some(stage.health()),
        answered: Some(Instant::now()),
        error: None,
    };
    let mut slots = status.stage_live.lock().unwrap_or_else(|e| e.into_inner());
    match slots.first_mut() {
        Some(slot) => *slot = live,
        None => slots.push(live),
    }
}

impl LocalExecutor {
    fn stopped(&mut self) -> StageFailure {
        // Panics in a micro-batch are caught; one outside it (freeing sequences, publishing
        // numbers) ends the thread. Joined only once finished, so this never blocks.
        let finished = self.thread.take_if(|t| t.is_finished());
        let panicked = finished.is_some_and(|t| t.join().is_err());
        StageFailure::new(if panicked {
            "the in-process stage panicked".to_string()
        } else {
            "the in-process stage stopped".to_string()
        })
    }
}

impl Executor for LocalExecutor {
    fn depth(&self) -> usize {
        1
    }

    async fn submit(&mut self, batch: MicroBatch) -> Result<(), StageFailure> {
        if self.commands.send(Command::Run(batch)).is_err() {
            return Err(self.stopped());
        }
        Ok(())
    }

    async fn next_result(&mut self) -> Result<BatchResult, StageFailure> {
        match self.results.recv().await {
            Some(r) => Ok(r),
            None => Err(self.stopped()),
        }
    }

    fn free(&self, ids: Vec<u64>) {
        if !ids.is_empty() {
            // A send fails only when the thread is gone, which the next submit reports.
            let _ = self.commands.send(Command::Free(ids));
        }
    }

    async fn watch(&mut self) -> StageFailure {
        std::future::pending().await
    }
}
