//! The step loop: each step sends one micro-batch (new sequences' prompts and running
//! sequences' last token) down the pipeline and hands the sampled tokens to their requests.
//! One micro-batch is in flight at a time; pipelining several is the batching work's job.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use baton_shared::proto::{FreeRequest, HealthRequest, MicroBatch, Sampling, SequenceChunk};
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::supervisor::Pipeline;
use super::{NewSequence, PipelineConfig, PipelineStatus};
use crate::generation::{FinishReason, GenerationRequest, TokenEvent, TokenLogprobs};
use crate::registry::Cluster;

/// Why the step loop returned.
pub(crate) enum StepLoopEnd {
    /// Every `PipelineGenerator` handle is gone.
    Shutdown,
    /// A stage failed; `worker_id` names it when it could be identified.
    StageFailed { reason: String, worker_id: Option<String> },
}

struct Seq {
    id: u64,
    submitted: Instant,
    last_token: Option<Instant>,
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Prompt tokens already sent down the pipeline (prefill may take several steps).
    prefilled: usize,
    /// Part of a micro-batch that has not come back yet.
    in_flight: bool,
    req: GenerationRequest,
    tx: mpsc::Sender<TokenEvent>,
}

impl Seq {
    /// Whether the workers hold KV for this sequence.
    fn holds_kv(&self) -> bool {
        self.prefilled > 0
    }

    fn decoding(&self) -> bool {
        self.prefilled == self.prompt_len
    }

    /// The last sampled token, to extend the sequence by one position.
    fn decode_chunk(&self) -> SequenceChunk {
        let pos = self.tokens.len() - 1;
        SequenceChunk {
            seq_id: self.id,
            tokens: vec![self.tokens[pos]],
            pos0: pos as u32,
            sample: true,
            sampling: None,
        }
    }

    /// The next `n` prompt tokens; the chunk that completes the prompt samples the first token.
    fn prefill_chunk(&mut self, n: usize) -> SequenceChunk {
        let p = &self.req.params;
        let pos0 = self.prefilled;
        self.prefilled += n;
        SequenceChunk {
            seq_id: self.id,
            tokens: self.tokens[pos0..pos0 + n].to_vec(),
            pos0: pos0 as u32,
            sample: self.prefilled == self.prompt_len,
            sampling: (pos0 == 0).then_some(Sampling {
                temperature: p.temperature,
                top_k: p.top_k as u32,
                top_p: p.top_p,
                min_p: p.min_p,
                seed: p.seed,
                logprobs: self.req.logprobs,
                top_logprobs: self.req.top_logprobs as u32,
            }),
        }
    }

    fn finish_reason(&self, config: &PipelineConfig, token: u32) -> Option<FinishReason> {
        let generated = self.tokens.len() - self.prompt_len;
        let is_eos = config.eos_ids.contains(&token);
        self.req
            .params
            .finish_reason(token, is_eos, generated, self.tokens.len(), config.max_context)
    }
}

/// One step's chunks: every decoding sequence's next token first (running sequences keep their
/// pace), then prompt chunks in arrival order while the step's token budget lasts, so a long
/// prompt is prefilled over several steps instead of stalling everyone's decode.
/// Returns the chunks and how many of them are decode tokens.
fn compose_step(active: &mut [&mut Seq], budget: usize) -> (Vec<SequenceChunk>, usize) {
    let mut chunks: Vec<SequenceChunk> = active
        .iter()
        .filter(|s| s.decoding())
        .map(|s| s.decode_chunk())
        .collect();
    let decode = chunks.len();
    let mut used = decode;
    for seq in active.iter_mut().filter(|s| !s.decoding()) {
        let left = budget.saturating_sub(used);
        if left == 0 {
            break;
        }
        let n = left.min(seq.prompt_len - seq.prefilled);
        chunks.push(seq.prefill_chunk(n));
        used += n;
    }
    (chunks, decode)
}

/// Drop sequences' KV on every stage, without waiting.
fn free_everywhere(pipeline: &Pipeline, ids: Vec<u64>) {
    if ids.is_empty() {
        return;
    }
    for (_, client) in &pipeline.stages {
        let mut client = client.clone();
        let ids = ids.clone();
        tokio::spawn(async move {
            if let Err(e) = client.free(FreeRequest { seq_ids: ids }).await {
                tracing::debug!(error = %e.message(), "free failed");
            }
        });
    }
}

/// Probe every stage; the first that does not answer is the failed one.
async fn find_failed_stage(pipeline: &Pipeline, cluster: &Cluster) -> Option<String> {
    for (a, client) in &pipeline.stages {
        let mut client = client.clone();
        let ok = tokio::time::timeout(Duration::from_secs(2), client.health(HealthRequest {})).await;
        if !matches!(ok, Ok(Ok(_))) || !cluster.is_alive(&a.worker_id) {
            return Some(a.worker_id.clone());
        }
    }
    None
}

/// Count a finished request by how it ended, with its end-to-end latency.
fn record_outcome(seq: &Seq, outcome: &'static str) {
    metrics::counter!("baton_requests_finished_total", "outcome" => outcome).increment(1);
    metrics::histogram!("baton_request_duration_seconds").record(seq.submitted.elapsed().as_secs_f64());
}

fn fail_all(active: &mut Vec<Seq>, reason: &str) {
    for s in active.drain(..) {
        record_outcome(&s, "failed");
        let _ = s.tx.try_send(TokenEvent::Failed {
            message: reason.to_string(),
            retriable: true,
        });
    }
}

/// Run steps until the pipeline fails or the generator is dropped.
pub(crate) async fn run(
    config: &PipelineConfig,
    cluster: &Cluster,
    pipeline: &Pipeline,
    submit_rx: &mut mpsc::Receiver<NewSequence>,
    status: &PipelineStatus,
) -> StepLoopEnd {
    let stage_failed = |reason: String, worker_id| StepLoopEnd::StageFailed { reason, worker_id };
    let mut stage0 = pipeline.stages[0].1.clone();
    let (batch_tx, batch_rx) = mpsc::channel::<MicroBatch>(4);
    let mut results = match stage0.forward(ReceiverStream::new(batch_rx)).await {
        Ok(r) => r.into_inner(),
        Err(e) => return stage_failed(format!("stage 0 refused the forward stream: {}", e.message()), None),
    };
    let mut active: Vec<Seq> = Vec::new();
    // Micro-batches sent and not yet answered, oldest first (stage streams keep order).
    let mut in_flight: VecDeque<InFlight> = VecDeque::new();
    let depth = pipeline.stages.len();
    let mut batch_id = 0u64;
    let mut tick = tokio::time::interval(cluster.heartbeat_interval);
    let dead_stage = || {
        pipeline
            .stages
            .iter()
            .find(|(a, _)| !cluster.is_alive(&a.worker_id))
            .map(|(a, _)| a.clone())
    };
    loop {
        status.active_sequences.store(active.len() as u64, Ordering::Relaxed);
        if active.is_empty() {
            tokio::select! {
                s = submit_rx.recv() => match s {
                    Some(s) => active.push(new_seq(s)),
                    None => return StepLoopEnd::Shutdown,
                },
                _ = tick.tick() => {
                    if let Some(a) = dead_stage() {
                        return stage_failed(format!("worker {} ({}) stopped heartbeating", a.worker_id, a.address), Some(a.worker_id));
                    }
                    continue;
                }
            }
        }
        // Admit waiting requests up to the running limit; the rest stay queued in the channel,
        // whose capacity bounds the queue (submissions beyond it get 429).
        while active.len() < config.max_running
            && let Ok(s) = submit_rx.try_recv()
        {
            active.push(new_seq(s));
        }
        // Requests whose client went away: stop them and free their KV. One with a micro-batch
        // in flight is dropped when that batch returns, so Free cannot overtake it.
        let (gone, kept): (Vec<Seq>, Vec<Seq>) = active.into_iter().partition(|s| s.tx.is_closed() && !s.in_flight);
        active = kept;
        gone.iter().for_each(|s| record_outcome(s, "cancelled"));
        free_everywhere(pipeline, gone.iter().filter(|s| s.holds_kv()).map(|s| s.id).collect());
        metrics::gauge!("baton_running_sequences").set(active.len() as f64);
        metrics::gauge!("baton_queue_depth").set(submit_rx.len() as f64);

        // Keep up to one micro-batch per stage in flight, over disjoint sequences, so every
        // stage has work under load. Each takes its share of the idle sequences.
        while in_flight.len() < depth {
            let idle_count = active.iter().filter(|s| !s.in_flight).count();
            let share = idle_count.div_ceil(depth - in_flight.len()).max(1);
            let mut idle: Vec<&mut Seq> = active.iter_mut().filter(|s| !s.in_flight).take(share).collect();
            if idle.is_empty() {
                break;
            }
            let (seqs, decode) = compose_step(&mut idle, config.max_batch_tokens);
            if seqs.is_empty() {
                break;
            }
            let members: Vec<u64> = seqs.iter().map(|c| c.seq_id).collect();
            for s in idle.iter_mut().filter(|s| members.contains(&s.id)) {
                s.in_flight = true;
            }
            batch_id += 1;
            let batch_tokens: usize = seqs.iter().map(|c| c.tokens.len()).sum();
            metrics::counter!("baton_prefill_tokens_total").increment((batch_tokens - decode) as u64);
            metrics::counter!("baton_decode_tokens_total").increment(decode as u64);
            metrics::histogram!("baton_step_batch_tokens").record(batch_tokens as f64);
            tracing::debug!(
                batch_id,
                sequences = members.len(),
                batch_tokens,
                in_flight = in_flight.len() + 1,
                "micro-batch sent"
            );
            if batch_tx
                .send(MicroBatch {
                    batch_id,
                    seqs,
                    hidden: None,
                })
                .await
                .is_err()
            {
                let reason = "stage 0 closed the forward stream".to_string();
                fail_all(&mut active, &reason);
                return stage_failed(reason, find_failed_stage(pipeline, cluster).await);
            }
            in_flight.push_back(InFlight {
                batch_id,
                members,
                sent: Instant::now(),
            });
            status
                .max_in_flight
                .fetch_max(in_flight.len() as u64, Ordering::Relaxed);
            metrics::gauge!("baton_micro_batches_in_flight").set(in_flight.len() as f64);
        }
        if in_flight.is_empty() {
            continue;
        }

        let reply = loop {
            tokio::select! {
                r = results.next() => break r,
                _ = tick.tick() => {
                    if let Some(a) = dead_stage() {
                        let reason = format!("worker {} ({}) stopped heartbeating", a.worker_id, a.address);
                        fail_all(&mut active, &reason);
                        return stage_failed(reason, Some(a.worker_id));
                    }
                }
            }
        };
        let reply = match reply {
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                let reason = format!("pipeline stage unavailable: {}", e.message());
                fail_all(&mut active, &reason);
                return stage_failed(reason, find_failed_stage(pipeline, cluster).await);
            }
            None => {
                let reason = "stage 0 ended the forward stream".to_string();
                fail_all(&mut active, &reason);
                return stage_failed(reason, find_failed_stage(pipeline, cluster).await);
            }
        };
        let Some(done_batch) = in_flight.pop_front().filter(|b| b.batch_id == reply.batch_id) else {
            let reason = format!("stage 0 answered micro-batch {} out of order", reply.batch_id);
            fail_all(&mut active, &reason);
            return stage_failed(reason, None);
        };
        let _span = tracing::info_span!(
            "scheduler.step",
            batch_id = done_batch.batch_id,
            sequences = done_batch.members.len()
        )
        .entered();
        metrics::histogram!("baton_step_seconds").record(done_batch.sent.elapsed().as_secs_f64());
        for s in active.iter_mut().filter(|s| done_batch.members.contains(&s.id)) {
            s.in_flight = false;
        }
        if !reply.error.is_empty() {
            // A bad batch (not a dead stage): fail its sequences, keep serving the others.
            tracing::warn!(error = %reply.error, "micro-batch failed");
            let (failed, kept): (Vec<Seq>, Vec<Seq>) =
                active.into_iter().partition(|s| done_batch.members.contains(&s.id));
            active = kept;
            for s in &failed {
                record_outcome(s, "failed");
                let _ = s.tx.try_send(TokenEvent::Failed {
                    message: reply.error.clone(),
                    retriable: false,
                });
            }
            free_everywhere(pipeline, failed.iter().map(|s| s.id).collect());
            continue;
        }
        let mut finished = Vec::new();
        for r in reply.results {
            let Some(seq) = active.iter_mut().find(|s| s.id == r.seq_id) else {
                continue;
            };
            seq.tokens.push(r.token);
            let now = Instant::now();
            match seq.last_token {
                None => {
                    metrics::histogram!("baton_time_to_first_token_seconds").record((now - seq.submitted).as_secs_f64())
                }
                Some(prev) => {
                    metrics::histogram!("baton_inter_token_latency_seconds").record((now - prev).as_secs_f64())
                }
            }
            seq.last_token = Some(now);
            let logprobs = seq.req.logprobs.then(|| TokenLogprobs {
                logprob: r.logprob,
                top: r.top_ids.into_iter().zip(r.top_logprobs).collect(),
            });
            let delivered = seq.tx.try_send(TokenEvent::Token { id: r.token, logprobs }).is_ok();
            let done = seq.finish_reason(config, r.token);
            if let Some(reason) = done {
                // Metrics first: a client that sees Done may read /metrics at once.
                record_outcome(seq, reason.as_str());
                let _ = seq.tx.try_send(TokenEvent::Done { reason });
            } else if !delivered {
                record_outcome(seq, "cancelled");
            }
            if !delivered || done.is_some() {
                finished.push(seq.id);
            }
        }
        active.retain(|s| !finished.contains(&s.id));
        free_everywhere(pipeline, finished);
    }
}

/// A micro-batch on its way through the pipeline.
struct InFlight {
    batch_id: u64,
    members: Vec<u64>,
    sent: Instant,
}

fn new_seq(s: NewSequence) -> Seq {
    Seq {
        id: s.id,
        submitted: s.submitted,
        last_token: None,
        prefilled: 0,
        in_flight: false,
        prompt_len: s.req.prompt.len(),
        tokens: s.req.prompt.clone(),
        req: s.req,
        tx: s.tx,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(id: u64, prompt: usize, generated: usize) -> Seq {
        let (tx, _rx) = mpsc::channel(1);
        let tokens: Vec<u32> = (0..(prompt + generated) as u32).collect();
        let req = GenerationRequest {
            prompt: tokens[..prompt].to_vec(),
            params: baton_shared::sampling::SamplingParams::greedy(100),
            top_logprobs: 0,
            logprobs: false,
        };
        let prefilled = if generated > 0 { prompt } else { 0 };
        Seq {
            id,
            submitted: Instant::now(),
            last_token: None,
            tokens,
            prompt_len: prompt,
            prefilled,
            in_flight: false,
            req,
            tx,
        }
    }

    /// Compose over every sequence, as the step loop does when nothing is in flight.
    fn compose_all(active: &mut [Seq], budget: usize) -> (Vec<SequenceChunk>, usize) {
        let mut all: Vec<&mut Seq> = active.iter_mut().collect();
        compose_step(&mut all, budget)
    }

    #[test]
    fn long_prompt_is_chunked_under_the_budget_while_others_decode() {
        // Three sequences decoding, one 2,000-token prompt arriving; budget 256 tokens a step.
        let mut active = vec![seq(1, 5, 3), seq(2, 9, 1), seq(3, 4, 7), seq(4, 2000, 0)];
        let mut steps = 0;
        let mut sent = 0;
        while !active[3].decoding() {
            let (chunks, decode) = compose_all(&mut active, 256);
            steps += 1;
            let tokens: usize = chunks.iter().map(|c| c.tokens.len()).sum();
            assert!(tokens <= 256, "step {steps} has {tokens} tokens");
            assert_eq!(decode, 3, "every running sequence decodes in every step");
            for id in 1..=3 {
                assert!(chunks.iter().any(|c| c.seq_id == id && c.tokens.len() == 1 && c.sample));
            }
            let long: Vec<_> = chunks.iter().filter(|c| c.seq_id == 4).collect();
            assert_eq!(long.len(), 1);
            assert_eq!(long[0].pos0 as usize, sent, "chunks are contiguous");
            assert_eq!(
                long[0].sampling.is_some(),
                sent == 0,
                "sampling settings travel with the first chunk"
            );
            sent += long[0].tokens.len();
            assert_eq!(long[0].sample, sent == 2000, "only the last chunk samples");
        }
        assert_eq!(sent, 2000);
        assert_eq!(steps, 2000_usize.div_ceil(253));
    }

    #[test]
    fn prompts_wait_when_decodes_fill_the_budget() {
        let mut active = vec![seq(1, 3, 1), seq(2, 3, 1), seq(3, 10, 0)];
        let (chunks, decode) = compose_all(&mut active, 2);
        assert_eq!((chunks.len(), decode), (2, 2));
        assert!(!active[2].holds_kv());
        let (chunks, _) = compose_all(&mut active, 5);
        assert_eq!(chunks.iter().find(|c| c.seq_id == 3).map(|c| c.tokens.len()), Some(3));
    }
}
