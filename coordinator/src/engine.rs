//! The one loop every mode runs: requests in, [`Scheduler`] decisions out to an [`Executor`]
//! (a pipeline of gRPC workers or the in-process stage), results back into the scheduler, and
//! its events out to each request's channel. All I/O of serving lives here; what to run and
//! what a result means is the scheduler's.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;

use tokio::sync::mpsc;

use crate::executor::{Executor, StageFailure};
use crate::generation::TokenEvent;
use crate::pipeline::{NewSequence, PipelineConfig, PipelineStatus, SeqRequest};
use crate::scheduler::{Outbox, Scheduler};

/// Why the engine returned.
pub(crate) enum EngineEnd {
    /// Every `PipelineGenerator` handle is gone.
    Shutdown,
    /// A stage failed, or a better pipeline can be built (`StageFailure::planned`): every
    /// sequence it held is in the backlog to resume on the next pipeline, except those past
    /// their migration limit, which have been told.
    Interrupted(StageFailure),
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

/// Serve requests on `exec` (whose stages hold `kv_blocks` KV blocks each) until a stage
/// fails, a better pipeline can be built, or the generator is dropped. Sequences in `backlog`
/// (moved from a pipeline before this one, then requests queued meanwhile) are admitted
/// before new submissions from `submit_rx`; when this pipeline ends, every sequence it holds
/// goes back into `backlog`, ahead of what is still there.
pub(crate) async fn run<E: Executor>(
    config: &PipelineConfig,
    exec: &mut E,
    kv_blocks: usize,
    submit_rx: &mut mpsc::Receiver<NewSequence>,
    backlog: &mut VecDeque<NewSequence>,
    status: &PipelineStatus,
) -> EngineEnd {
    let mut sched = Scheduler::new(config, status, exec.depth(), kv_blocks);
    let mut requests = Requests::default();
    let mut out = Outbox::default();
    // A planned rebuild waits for the micro-batches in flight, sending no new ones.
    let mut draining: Option<StageFailure> = None;
    loop {
        if draining.is_none() {
            draining = exec.replan();
        }
        if sched.is_idle() && backlog.is_empty() {
            if let Some(planned) = draining.take() {
                return interrupted(planned, &mut sched, &mut requests, backlog, &mut out, status);
            }
            tokio::select! {
                s = submit_rx.recv() => match s {
                    Some(s) => {
                        let first = requests.accept(s);
                        let mut once = Some(first);
                        sched.admit(|| once.take(), &mut out);
                    }
                    None => return EngineEnd::Shutdown,
                },
                failure = exec.watch() => {
                    return interrupted(failure, &mut sched, &mut requests, backlog, &mut out, status);
                }
            }
        }
        if draining.is_none() {
            // Requests stay in the submission channel (whose capacity bounds the queue, beyond
            // which submissions get 429) until the scheduler can admit them.
            sched.admit(
                || {
                    backlog
                        .pop_front()
                        .or_else(|| submit_rx.try_recv().ok())
                        .map(|s| requests.accept(s))
                },
                &mut out,
            );
        }
        let stopped = sched.abort(&requests.gone(), &mut out);
        requests.forget(&stopped);
        metrics::gauge!("baton_queue_depth").set((submit_rx.len() + backlog.len()) as f64);
        if draining.is_none() {
            sched.schedule(&mut out);
        }
        if let Err(failure) = carry_out(exec, &mut sched, &mut requests, &mut out).await {
            return interrupted(failure, &mut sched, &mut requests, backlog, &mut out, status);
        }
        if sched.in_flight() == 0 {
            if let Some(planned) = draining.take() {
                return interrupted(planned, &mut sched, &mut requests, backlog, &mut out, status);
            }
            continue;
        }
        let reply = match exec.next_result().await {
            Ok(r) => r,
            Err(failure) => return interrupted(failure, &mut sched, &mut requests, backlog, &mut out, status),
        };
        if let Err(reason) = sched.on_result(reply, &mut out) {
            let failure = StageFailure::new(reason);
            return interrupted(failure, &mut sched, &mut requests, backlog, &mut out, status);
        }
        if let Err(failure) = carry_out(exec, &mut sched, &mut requests, &mut out).await {
            return interrupted(failure, &mut sched, &mut requests, backlog, &mut out, status);
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
    out.free_in_band.extend_from_slice(&out.free);
    exec.free(std::mem::take(&mut out.free));
    for mut batch in out.batches.drain(..) {
        batch.free = std::mem::take(&mut out.free_in_band);
        exec.submit(batch).await?;
    }
    Ok(())
}

/// This pipeline ends: move every sequence it holds to the front of `backlog` (with its
/// channel, so its client's stream continues on the next pipeline), and tell those past their
/// migration limit.
fn interrupted(
    failure: StageFailure,
    sched: &mut Scheduler<'_>,
    requests: &mut Requests,
    backlog: &mut VecDeque<NewSequence>,
    out: &mut Outbox,
    status: &PipelineStatus,
) -> EngineEnd {
    let moved = sched.evacuate(&failure.reason, failure.planned.is_none(), out);
    requests.deliver(out);
    let mut resumed: VecDeque<NewSequence> = moved
        .into_iter()
        .filter_map(|request| {
            let tx = requests.senders.remove(&request.id)?;
            Some(NewSequence { request, tx })
        })
        .collect();
    let cause = if failure.planned.is_some() {
        "replan"
    } else {
        "stage_failed"
    };
    let n = resumed.iter().filter(|s| s.request.resume.is_some()).count() as u64;
    metrics::counter!("baton_sequence_migrations_total", "cause" => cause).increment(n);
    status.migrations.fetch_add(n, Ordering::Relaxed);
    if n > 0 {
        tracing::warn!(sequences = n, cause, reason = %failure.reason, "moving sequences to a rebuilt pipeline");
    }
    resumed.append(backlog);
    *backlog = resumed;
    EngineEnd::Interrupted(failure)
}
