//! Executors run micro-batches for the engine: [`grpc::GrpcExecutor`] through a chain of
//! worker processes, [`local::LocalExecutor`] on a stage in this process. The engine
//! (`crate::engine`) talks only to [`Executor`], so `baton serve --workers 0` gets the same
//! continuous batching, paged KV and prefix cache as a pipeline of workers.

pub(crate) mod grpc;
pub(crate) mod local;

use baton_shared::proto::{BatchResult, MicroBatch};

/// A stage that can no longer serve: the engine fails its sequences and the supervisor
/// rebuilds.
#[derive(Debug, Clone)]
pub(crate) struct StageFailure {
    pub reason: String,
    /// The worker that failed, when it could be identified (it is dropped from the cluster).
    pub worker_id: Option<String>,
    /// Nothing failed: a better pipeline can be built, for this reason (`workers_joined` a
    /// degraded one, `measured_drift` of stage times from the plan). The engine drains its
    /// micro-batches first, and the move does not count toward a sequence's migration limit.
    pub planned: Option<&'static str>,
}

impl StageFailure {
    /// A failure not pinned on a known worker.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            worker_id: None,
            planned: None,
        }
    }

    /// A failure of `worker_id`.
    pub fn of_worker(reason: impl Into<String>, worker_id: &str) -> Self {
        Self {
            worker_id: Some(worker_id.to_string()),
            ..Self::new(reason)
        }
    }

    /// A rebuild for a better pipeline (`why`: the metric label), no stage having failed.
    pub fn planned(why: &'static str, reason: impl Into<String>) -> Self {
        Self {
            planned: Some(why),
            ..Self::new(reason)
        }
    }
}

/// Runs micro-batches through every stage and hands back what the last stage sampled.
pub(crate) trait Executor {
    /// Stages a micro-batch passes through: the scheduler keeps up to this many in flight.
    fn depth(&self) -> usize;

    /// Send a micro-batch into the first stage.
    async fn submit(&mut self, batch: MicroBatch) -> Result<(), StageFailure>;

    /// The next result, in the order micro-batches were submitted (call only with one in
    /// flight). Resolves with a failure when a stage dies while it waits.
    async fn next_result(&mut self) -> Result<BatchResult, StageFailure>;

    /// Drop sequences' state (KV) on every stage, without waiting. Only sequences with no
    /// micro-batch in flight are freed, so this never overtakes their last batch.
    fn free(&self, ids: Vec<u64>);

    /// Resolves when a stage is known to be dead, or a planned rebuild is due, while nothing
    /// is in flight (the engine waits on this beside new requests); never resolves while
    /// every stage lives and the pipeline is the one wanted.
    async fn watch(&mut self) -> StageFailure;

    /// A planned rebuild that is due (checked once per engine step, so cheap): the engine
    /// stops sending, drains what is in flight, then moves its sequences.
    fn replan(&mut self) -> Option<StageFailure> {
        None
    }
}
