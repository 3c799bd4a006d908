//! The one loop every mode runs: requests in, [`Scheduler`] decisions out to an [`Executor`]
//! (a pipeline of gRPC workers or the in-process stage), results back into the scheduler, and
//! its events out to each request's channel. All I/O of serving lives here; what to run and
//! what a result means is the scheduler's.

use std::collections::HashMap;

use tokio::sync::mpsc;

use crate::executor::{Executor, StageFailure};
use crate::generation::TokenEvent;
use crate::pipeline::{NewSequence, PipelineConfig, PipelineStatus, SeqRequest};
use crate::scheduler::{Outbox, Scheduler};

/// Why the engine returned.
pub(crate) enum EngineEnd {
    /// Every `PipelineGenerator` handle is gone.
    Shutdown,
    /// A stage failed; every request it held has been told.
    StageFailed(StageFailure),
}

/// Each request's event channel, by sequence id.
#[derive(Default)]
struct Requests {
    senders: HashMap<u64, mpsc::Sender<TokenEvent>>,
}

impl Requests {
    /// Keep the request's channel; hand the rest to the scheduler.
    fn accept(&mut self, s: NewSequence) -> SeqRequest {
        self.senders.insert(s.request.id, s.tx);
        s.request
    }

    /// Requests whose receiver is gone (the client left).
    fn gone(&self) -> Vec<u64> {
        // Only live requests are here: stopped ones are forgotten (`forget`).
        self.senders
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Drop the channels of requests the scheduler stopped without an end event: their
    /// receivers (if still there) see the stream end.
    fn forget(&mut self, ids: &[u64]) {
        for id in ids {
            self.senders.remove(id);
        }
    }

    /// Deliver the outbox's events without waiting; returns the sequences whose client could
    /// not take a token (it left, or stopped reading and filled its channel).
    fn deliver(&mut self, out: &mut Outbox) -> Vec<u64> {
        let mut undelivered = Vec::new();
        for (id, event) in out.events.drain(..) {
            let terminal = matches!(event, TokenEvent::Done { .. } | TokenEvent::Failed { .. });
            let Some(tx) = self.senders.get(&id) else { continue };
            if tx.try_send(event).is_err() && !terminal {
                undelivered.push(id);
            }
            if terminal {
                self.senders.remove(&id);
            }
        }
        undelivered
    }
}

/// Serve requests from `submit_rx` on `exec` (whose stages hold `kv_blocks` KV blocks each)
/// until a stage fails or the generator is dropped.
pub(crate) async fn run<E: Executor>(
    config: &PipelineConfig,
    exec: &mut E,
    kv_blocks: usize,
    submit_rx: &mut mpsc::Receiver<NewSequence>,
    status: &PipelineStatus,
) -> EngineEnd {
    let mut sched = Scheduler::new(config, status, exec.depth(), kv_blocks);
    let mut requests = Requests::default();
    let mut out = Outbox::default();
    loop {
        if sched.is_idle() {
            tokio::select! {
                s = submit_rx.recv() => match s {
                    Some(s) => {
                        let first = requests.accept(s);
                        let mut once = Some(first);
                        sched.admit(|| once.take(), &mut out);
                    }
                    None => return EngineEnd::Shutdown,
                },
                failure = exec.watch() => return EngineEnd::StageFailed(failure),
            }
        }
        // Requests stay in the submission channel (whose capacity bounds the queue, beyond
        // which submissions get 429) until the scheduler can admit them.
        sched.admit(|| submit_rx.try_recv().ok().map(|s| requests.accept(s)), &mut out);
        let stopped = sched.abort(&requests.gone(), &mut out);
        requests.forget(&stopped);
        metrics::gauge!("baton_queue_depth").set(submit_rx.len() as f64);
        sched.schedule(&mut out);
        if let Err(failure) = carry_out(exec, &mut sched, &mut requests, &mut out).await {
            return fail(failure, &mut sched, &mut requests, &mut out);
        }
        if sched.in_flight() == 0 {
            continue;
        }
        let reply = match exec.next_result().await {
            Ok(r) => r,
            Err(failure) => return fail(failure, &mut sched, &mut requests, &mut out),
        };
        if let Err(reason) = sched.on_result(reply, &mut out) {
            return fail(StageFailure::new(reason), &mut sched, &mut requests, &mut out);
        }
        if let Err(failure) = carry_out(exec, &mut sched, &mut requests, &mut out).await {
            return fail(failure, &mut sched, &mut requests, &mut out);
        }
    }
}

/// Deliver the outbox's events, free what it frees and send its micro-batches; a client that
/// could not take its token is aborted (its KV freed in this same outbox, or once its
/// micro-batch is back).
async fn carry_out<E: Executor>(
    exec: &mut E,
    sched: &mut Scheduler<'_>,
    requests: &mut Requests,
    out: &mut Outbox,
) -> Result<(), StageFailure> {
    let undelivered = requests.deliver(out);
    let stopped = sched.abort(&undelivered, out);
    requests.forget(&stopped);
    exec.free(std::mem::take(&mut out.free));
    for batch in out.batches.drain(..) {
        exec.submit(batch).await?;
    }
    Ok(())
}

/// Tell every request the pipeline broke.
fn fail(failure: StageFailure, sched: &mut Scheduler<'_>, requests: &mut Requests, out: &mut Outbox) -> EngineEnd {
    sched.fail_all(&failure.reason, out);
    requests.deliver(out);
    EngineEnd::StageFailed(failure)
}
