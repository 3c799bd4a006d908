//! The scheduler: which sequences go into the next micro-batches, and what their results mean
//! for each request. It owns admission, the KV block allocator with its prefix index, and
//! preemption, and does no I/O: [`Scheduler::schedule`] and [`Scheduler::on_result`] fill an
//! [`Outbox`] (micro-batches to send, sequences to free, events for requests) that the engine
//! (`crate::engine`) carries out on an executor.
//!
//! Up to one micro-batch per stage is in flight. A decoding sequence is in one of them at a
//! time (its next token needs the last one); a prompt's chunks may be in several, one per
//! micro-batch (a wavefront: chunk k + 1 enters stage 0 while chunk k is on stage 1), since
//! every stage runs its micro-batches in the order they were sent and so has the earlier
//! chunks' K/V before a later chunk's attention needs it. A new (or preempted) sequence first
//! takes the cached blocks its tokens start with (`kv_blocks`), and blocks its micro-batches
//! fill are indexed for later prompts when they come back.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Instant;

use baton_shared::proto::{BatchResult, MicroBatch, Sampling, SequenceChunk};

use crate::generation::{FinishReason, GenerationRequest, TokenEvent, TokenLogprobs};
use crate::pipeline::kv_blocks::{BlockAllocator, IndexProgress};
use crate::pipeline::{PipelineConfig, PipelineStatus, Resume, SeqRequest};
use crate::speculative::{Adaptive, Drafter, SpeculativeConfig};

/// What the scheduler hands the engine to carry out, in order: events first, then frees, then
/// micro-batches.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    /// Events for requests, by sequence id.
    pub events: Vec<(u64, TokenEvent)>,
    /// Sequences whose KV every stage should drop.
    pub free: Vec<u64>,
    /// Those freed since the last micro-batch was sent: the next one carries them, so every
    /// stage drops them before it runs a chunk that may need their slots.
    pub free_in_band: Vec<u64>,
    /// Micro-batches to send into the first stage, in order.
    pub batches: Vec<MicroBatch>,
}

impl Outbox {
    fn event(&mut self, id: u64, event: TokenEvent) {
        self.events.push((id, event));
    }
}

struct Seq {
    id: u64,
    submitted: Instant,
    last_token: Option<Instant>,
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens to prefill before decoding: the prompt, or after a preemption every token so far.
    prefill_len: usize,
    /// Tokens already sent down the pipeline for prefill (it may take several steps).
    prefilled: usize,
    /// KV block table (ids from the pipeline's allocator, the same on every stage).
    blocks: Vec<u32>,
    /// Positions taken from the prefix cache when the sequence (re)started: its first chunk
    /// begins there.
    reused: usize,
    /// How far `blocks` has been offered to the prefix index.
    indexed: IndexProgress,
    /// Hybrid models: the state snapshot its reused prefix ends with, which its first chunk
    /// starts the recurrent state from.
    restore: Option<u32>,
    /// The request has been told how many prompt tokens came from the prefix cache.
    cached_reported: bool,
    /// Micro-batches holding a chunk of it that have not come back yet (more than one only
    /// while its prompt is prefilled as a wavefront).
    in_flight: u32,
    /// Positions whose K/V every stage has written: the end of its latest chunk that came back.
    landed: usize,
    /// Its client went away while chunks were in flight: nothing more is sent for it, and it
    /// is stopped once they are back.
    cancelled: bool,
    /// A micro-batch of it failed while other chunks were in flight: the request has been
    /// told, and its KV is released once those chunks are back (a stage still writes them).
    failed: bool,
    /// Id of the latest micro-batch it was part of (0: none yet).
    last_batch: u64,
    /// Times it moved to a rebuilt pipeline.
    migrations: u32,
    /// Speculative decoding: proposals per verify step at most (0: off for this sequence).
    spec_tokens: usize,
    /// How many it asks for next.
    pace: Adaptive,
    /// The proposals its micro-batch in flight carries (empty: a plain decode step).
    draft: Vec<u32>,
    /// DFlash: its chunks carry feature taps and ask the last stage to draft.
    taps: bool,
    /// DFlash: what the last stage drafted after its latest step, to verify next.
    drafted: Vec<u32>,
    req: GenerationRequest,
    /// Ends (and is exported) when the sequence is dropped.
    span: tracing::Span,
}

impl Seq {
    /// Whether the workers hold KV for this sequence.
    fn holds_kv(&self) -> bool {
        self.prefilled > 0
    }

    fn decoding(&self) -> bool {
        self.prefilled == self.prefill_len
    }

    /// Whether a chunk of it may join the next micro-batch: when none is in flight, or while
    /// its prompt still has chunks to send (they follow the ones in flight through every
    /// stage in order).
    fn schedulable(&self) -> bool {
        !self.cancelled && !self.failed && (self.in_flight == 0 || !self.decoding())
    }

    /// Drop this sequence's KV to make room for others; it is prefilled again from all its
    /// tokens later and then continues where it was (greedy output is unchanged; a seeded
    /// sampler skips the draws it made, so its random stream continues too).
    fn preempt(&mut self, alloc: &mut BlockAllocator) {
        debug_assert!(
            self.in_flight == 0,
            "a sequence with chunks in flight is never preempted"
        );
        alloc.release(&mut self.blocks);
        self.prefilled = 0;
        self.landed = 0;
        self.reused = 0;
        self.restore = None;
        self.indexed = IndexProgress::default();
        self.prefill_len = self.tokens.len();
        self.drafted.clear();
    }

    /// Before the first chunk of a (re)start: take the cached blocks the tokens to prefill start
    /// with, and begin prefilling after them.
    fn reuse_prefix(&mut self, alloc: &mut BlockAllocator, out: &mut Outbox) {
        debug_assert!(self.prefilled == 0 && self.blocks.is_empty());
        let reused = alloc.take_prefix(&mut self.blocks, &self.tokens[..self.prefill_len]);
        self.reused = reused;
        self.prefilled = reused;
        self.landed = reused;
        self.indexed = alloc.progress_after_prefix(&self.blocks);
        self.restore = match (reused, self.blocks.last()) {
            (1.., Some(&last)) => alloc.snapshot_of(last),
            _ => None,
        };
        self.span.record("cached_tokens", reused);
        // Reported once per request (usage.prompt_tokens_details), not again after a preemption.
        if reused > 0 && !self.cached_reported {
            self.cached_reported = true;
            out.event(self.id, TokenEvent::PromptCached { tokens: reused });
        }
    }

    /// The last sampled token, to extend the sequence by one position, followed by the
    /// proposals in `draft` for the last stage to verify.
    fn decode_chunk(&self) -> SequenceChunk {
        let pos = self.tokens.len() - 1;
        let mut tokens = Vec::with_capacity(1 + self.draft.len());
        tokens.push(self.tokens[pos]);
        tokens.extend_from_slice(&self.draft);
        SequenceChunk {
            seq_id: self.id,
            tokens,
            pos0: pos as u32,
            sample: true,
            sampling: None,
            blocks: self.blocks.clone(),
            cached: 0,
            draft: self.draft.len() as u32,
            taps: self.taps,
            propose: self.proposals_wanted(),
            restore_state: None,
            save_state: None,
            prompt_len: 0,
        }
    }

    /// Proposals a sampling chunk asks the last stage to draft (DFlash; 0 otherwise, and while
    /// its pace pauses drafting, so a draft that keeps missing costs the last stage nothing
    /// but its context rows).
    fn proposals_wanted(&self) -> u32 {
        match self.taps && !self.pace.pausing() {
            true => self.spec_tokens as u32,
            false => 0,
        }
    }

    /// Most proposals the next decode step may carry: its own pace within what the request
    /// may still generate (a draft's tokens all count toward `max_tokens`, and the step emits
    /// one more) and the context.
    fn draft_limit(&self, max_context: usize) -> usize {
        let generated = self.tokens.len() - self.prompt_len;
        let left = self.req.params.max_tokens.saturating_sub(generated + 1);
        let context = max_context.saturating_sub(self.tokens.len());
        self.spec_tokens.min(left).min(context)
    }

    /// The next `n` prompt tokens; the chunk that completes the prompt samples the first token.
    fn prefill_chunk(&mut self, n: usize) -> SequenceChunk {
        let p = &self.req.params;
        let pos0 = self.prefilled;
        let first = pos0 == self.reused;
        self.prefilled += n;
        let sample = self.prefilled == self.prefill_len;
        SequenceChunk {
            taps: self.taps,
            propose: if sample { self.proposals_wanted() } else { 0 },
            seq_id: self.id,
            tokens: self.tokens[pos0..pos0 + n].to_vec(),
            pos0: pos0 as u32,
            sample,
            blocks: self.blocks.clone(),
            cached: if first { self.reused as u32 } else { 0 },
            restore_state: if first { self.restore } else { None },
            save_state: None,
            prompt_len: self.prompt_len as u32,
            draft: 0,
            sampling: first.then_some(Sampling {
                temperature: p.temperature,
                top_k: p.top_k as u32,
                top_p: p.top_p,
                min_p: p.min_p,
                seed: p.seed,
                logprobs: self.req.logprobs,
                top_logprobs: self.req.top_logprobs as u32,
                drawn: (self.tokens.len() - self.prompt_len) as u32,
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

/// What [`compose_step`] chose.
struct Composed {
    chunks: Vec<SequenceChunk>,
    /// How many of the chunks are decode steps (they come first).
    decode: usize,
    /// Proposals those decode chunks carry after their one token each.
    draft: usize,
    /// Decoding sequences left out because no KV block was free for their next position.
    starved: Vec<u64>,
    /// A prefilling sequence that had budget but no free block for any of its positions.
    stalled: Option<u64>,
    /// Sequences that (re)started prefill this step: tokens they looked up in the prefix
    /// cache, and positions reused from it.
    prefix_queried: usize,
    prefix_reused: usize,
    /// State snapshots this step's prompt chunks fill (hybrid models).
    snapshots: Vec<PendingSnapshot>,
}

/// A state snapshot a prompt chunk fills on every stage, attached to the indexed block the
/// chunk ends with once the chunk is back.
#[derive(Debug, Clone, Copy)]
struct PendingSnapshot {
    seq_id: u64,
    /// Full blocks of the sequence's tokens the state covers.
    blocks: usize,
    snapshot: u32,
}

/// A hybrid prompt's chunk that finishes a prompt of at least this many full blocks first
/// stops at its last full block, so the state there is snapshotted too (at the price of one
/// short extra chunk; shorter prompts gain too little from the cache to pay it).
const TAIL_SNAPSHOT_MIN_BLOCKS: usize = 4;

/// How many of the `n` prompt tokens after `prefilled` a hybrid model's chunk takes, so that
/// it ends on a block boundary where the recurrent state can be snapshotted: a chunk that
/// does not finish the prompt ends on the last boundary it reaches (if it reaches one), and
/// the one that finishes a long enough prompt stops at its last full block first.
fn snapshot_aligned(prefilled: usize, n: usize, prefill_len: usize, block_size: usize) -> usize {
    let end = prefilled + n;
    let boundary = end / block_size * block_size;
    let finishes = end == prefill_len;
    let cut =
        boundary > prefilled && boundary < end && (!finishes || boundary >= TAIL_SNAPSHOT_MIN_BLOCKS * block_size);
    if cut { boundary - prefilled } else { n }
}

/// How many of the `n` prompt tokens after `prefilled` a hybrid model's chunk takes so that,
/// below `windowed` (the prompt's last whole delta-rule window), it ends on a `window`
/// boundary: cut back to the last boundary it reaches, or, reaching none, stretched to the
/// next one if `most` tokens allow (over the step's budget by less than a window), else none.
fn window_aligned(prefilled: usize, n: usize, windowed: usize, window: usize, most: usize) -> usize {
    let end = prefilled + n;
    if n == 0 || end >= windowed || end.is_multiple_of(window) {
        return n;
    }
    let down = end / window * window;
    if down > prefilled {
        return down - prefilled;
    }
    let up = (prefilled / window + 1) * window - prefilled;
    if up <= most { up } else { 0 }
}

/// The least common multiple of two positive counts.
fn lcm(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x.max(1) * b
}

/// How many idle decoding sequences the next micro-batch takes: the idle ones spread over the
/// `free` slots of `depth`, and never more than an equal share of all `decoding` sequences.
/// Sequences return together with the micro-batch they went in, so an uneven split persists,
/// and every stage waits for the larger micro-batch once a round: 16 decodes split 9/7 over two
/// stages take as long a round as 9/9 would. The cap evens such a split out on its next return.
fn micro_batch_share(decoding: usize, idle: usize, depth: usize, free: usize) -> usize {
    // The idle spread over at least one slot is never more than the idle count itself.
    idle.div_ceil(free.max(1)).min(decoding.div_ceil(depth.max(1)))
}

/// The idle sequences for the next micro-batch: decoding ones up to their share with `free` of
/// `depth` slots free, those that have waited longest for a micro-batch first (so the one a
/// capped batch left behind goes next); then every idle prompt in arrival order, for
/// [`compose_step`] to give chunks while the budget lasts.
///
/// Prompts are not counted against the share: capped by count, a micro-batch of decodes only
/// filled it, so prompt chunks only ever rode in the other micro-batch and two stages
/// alternated 8 tokens with 64 (measured on a Zen 4, 16 streams: 448 of 578 micro-batches
/// carried 8 tokens and 66 the whole budget). A pipeline runs each round at its heavier
/// micro-batch's pace, so every micro-batch now fills its budget with prompt tokens.
fn pick_idle(active: &mut [Seq], depth: usize, free: usize) -> Vec<&mut Seq> {
    let decoding = active.iter().filter(|s| s.decoding()).count();
    let (mut decodes, prompts): (Vec<&mut Seq>, Vec<&mut Seq>) = active
        .iter_mut()
        .filter(|s| s.schedulable())
        .partition(|s| s.decoding());
    let share = micro_batch_share(decoding, decodes.len(), depth, free);
    // Stable: ties keep arrival order.
    decodes.sort_by_key(|s| s.last_batch);
    decodes.truncate(share);
    decodes.extend(prompts);
    decodes
}

/// What [`compose_step`] may spend on speculative proposals.
struct Drafting<'d> {
    drafter: &'d mut dyn Drafter,
    max_context: usize,
    /// Free blocks proposals must leave for admitted prompts still to be prefilled.
    reserved_blocks: usize,
}

/// One step's chunks: every decoding sequence's next token first (running sequences keep their
/// pace), then prompt chunks in arrival order while the step's token budget lasts, so a long
/// prompt is prefilled over several steps instead of stalling everyone's decode. Each chunk's
/// positions get KV blocks first; a prompt chunk shrinks to the blocks there are. A sequence
/// starting its prefill first reuses the cached blocks its tokens begin with. With a drafter,
/// decode steps carry proposals from what the budget and the blocks leave after every
/// decoding sequence's own token (never taking blocks admitted prompts still need).
fn compose_step(
    active: &mut [&mut Seq],
    budget: usize,
    alloc: &mut BlockAllocator,
    mut drafting: Option<Drafting<'_>>,
    out: &mut Outbox,
) -> Composed {
    let mut c = Composed {
        chunks: Vec::new(),
        decode: 0,
        draft: 0,
        starved: Vec::new(),
        stalled: None,
        prefix_queried: 0,
        prefix_reused: 0,
        snapshots: Vec::new(),
    };
    let mut decoding = Vec::new();
    for (i, seq) in active.iter_mut().enumerate().filter(|(_, s)| s.decoding()) {
        if alloc.cover(&mut seq.blocks, seq.tokens.len()) {
            decoding.push(i);
        } else {
            c.starved.push(seq.id);
        }
    }
    let mut spare = budget.saturating_sub(decoding.len());
    for &i in &decoding {
        let seq = &mut active[i];
        seq.draft.clear();
        if let Some(d) = drafting.as_mut().filter(|_| seq.spec_tokens > 0) {
            let k = seq.pace.next(seq.draft_limit(d.max_context).min(spare), decoding.len());
            if k > 0 {
                match d.drafter.on_last_stage() {
                    true => seq.draft.extend(seq.drafted.iter().take(k)),
                    false => d.drafter.propose(&seq.tokens, k, &mut seq.draft),
                }
                seq.draft.truncate(k);
            }
            // Only blocks beyond what admitted prompts still need.
            let bs = alloc.block_size();
            let blocks = seq.blocks.len() + alloc.free().saturating_sub(d.reserved_blocks);
            seq.draft.truncate((blocks * bs).saturating_sub(seq.tokens.len()));
            let covered = alloc.cover(&mut seq.blocks, seq.tokens.len() + seq.draft.len());
            debug_assert!(covered, "the draft was cut to the blocks there are");
            spare -= seq.draft.len();
            c.draft += seq.draft.len();
        }
        c.chunks.push(seq.decode_chunk());
    }
    c.decode = c.chunks.len();
    let mut used = c.decode + c.draft;
    for seq in active.iter_mut().filter(|s| !s.decoding()) {
        let left = budget.saturating_sub(used);
        let starting = seq.prefilled == 0 && seq.blocks.is_empty();
        if left > 0 && starting {
            // Cached blocks are taken only when a chunk can follow them (a free block beyond
            // the idle ones taken): a sequence that cannot start holds nothing, so preempting
            // others always makes room for it instead of it pinning blocks it cannot use.
            let hit = alloc.peek_prefix(&seq.tokens[..seq.prefill_len]);
            if alloc.free() > hit.idle {
                seq.reuse_prefix(alloc, out);
            }
        }
        let room = (seq.blocks.len() + alloc.free()) * alloc.block_size() - seq.prefilled;
        let mut n = left.min(seq.prefill_len - seq.prefilled).min(room);
        let window = alloc.prompt_window();
        let windowed = seq.prompt_len / window * window;
        if window > 1 {
            let most = room.min(seq.prefill_len - seq.prefilled);
            n = window_aligned(seq.prefilled, n, windowed, window, most);
        }
        // Snapshots only where every earlier position ran in whole windows (see
        // `with_prompt_window`): a block boundary that is also a window boundary.
        let unit = lcm(alloc.block_size(), window);
        if alloc.keeps_snapshots() {
            n = snapshot_aligned(seq.prefilled, n, seq.prefill_len, unit);
        }
        if n == 0 {
            if left > 0 {
                c.stalled = Some(seq.id);
            }
            break;
        }
        if starting {
            c.prefix_queried += seq.prefill_len;
            c.prefix_reused += seq.reused;
        }
        let covered = alloc.cover(&mut seq.blocks, seq.prefilled + n);
        debug_assert!(covered, "room was counted from the free blocks");
        let mut chunk = seq.prefill_chunk(n);
        let end = seq.prefilled;
        // A chunk that ends on a block boundary snapshots the state there for the prefix cache.
        let snapshot = match alloc.keeps_snapshots() && end.is_multiple_of(unit) && end <= windowed {
            true => alloc.reserve_snapshot(),
            false => None,
        };
        if let Some(snapshot) = snapshot {
            chunk.save_state = Some(snapshot);
            c.snapshots.push(PendingSnapshot {
                seq_id: seq.id,
                blocks: end / alloc.block_size(),
                snapshot,
            });
        }
        c.chunks.push(chunk);
        used += n;
    }
    c
}

/// The sequence to preempt when `starved` ones need blocks: the newest idle sequence holding
/// any (first come, first served), preferring one whose release frees a block (one holding
/// only blocks other sequences share frees nothing). While micro-batches are in flight the
/// starved themselves are spared: the batches' return may free blocks.
fn preemption_victim(active: &[Seq], starved: &[u64], in_flight: bool, alloc: &BlockAllocator) -> Option<usize> {
    let candidates = || {
        active.iter().enumerate().rev().filter(|(_, s)| {
            let spared = in_flight && starved.contains(&s.id);
            let unavailable = s.in_flight > 0 || s.blocks.is_empty() || spared;
            !unavailable
        })
    };
    candidates()
        .find(|(_, s)| alloc.frees_any(&s.blocks))
        .or_else(|| candidates().next())
        .map(|(i, _)| i)
}

/// Whether a last stage's answer to a draft keeps to the rules: `token` then `more`, where all
/// but the last of them are the draft's first proposals in order (the accepted ones).
fn continues_draft(draft: &[u32], token: u32, more: &[u32]) -> bool {
    let accepted = more.len();
    accepted <= draft.len()
        && std::iter::once(&token)
            .chain(more)
            .take(accepted)
            .eq(&draft[..accepted])
}

/// Count one verify step: `proposed` tokens sent, `accepted` kept.
fn record_verify(
    method: Option<crate::speculative::DraftMethod>,
    proposed: usize,
    accepted: usize,
    status: &PipelineStatus,
) {
    let method = method.map_or("test", |m| m.as_str());
    metrics::counter!("baton_spec_proposed_tokens_total", "method" => method).increment(proposed as u64);
    metrics::counter!("baton_spec_accepted_tokens_total", "method" => method).increment(accepted as u64);
    metrics::histogram!("baton_spec_tokens_per_step", "method" => method).record((accepted + 1) as f64);
    for position in 1..=accepted {
        metrics::counter!("baton_spec_accepted_position_total", "method" => method, "position" => position.to_string())
            .increment(1);
    }
    status.spec_steps.fetch_add(1, Ordering::Relaxed);
    status
        .spec_proposed_tokens
        .fetch_add(proposed as u64, Ordering::Relaxed);
    status
        .spec_accepted_tokens
        .fetch_add(accepted as u64, Ordering::Relaxed);
}

/// Count a finished request by how it ended, with its end-to-end latency.
fn record_outcome(seq: &Seq, outcome: &'static str) {
    seq.span.record("finish_reason", outcome);
    seq.span.record("generated_tokens", seq.tokens.len() - seq.prompt_len);
    metrics::counter!("baton_requests_finished_total", "outcome" => outcome).increment(1);
    metrics::histogram!("baton_request_duration_seconds").record(seq.submitted.elapsed().as_secs_f64());
}

/// Admission, micro-batch composition, preemption and token bookkeeping for one pipeline.
pub(crate) struct Scheduler<'a> {
    config: &'a PipelineConfig,
    status: &'a PipelineStatus,
    active: Vec<Seq>,
    alloc: BlockAllocator,
    /// A request taken from the queue that waits for KV blocks before it is admitted.
    next_up: Option<SeqRequest>,
    /// Micro-batches sent and not yet answered, oldest first (stage streams keep order).
    in_flight: VecDeque<InFlight>,
    /// Micro-batches kept in flight at most: one per stage.
    depth: usize,
    batch_id: u64,
    /// Proposes tokens for decode steps to carry (speculative decoding); None when off.
    drafter: Option<Box<dyn Drafter>>,
}

impl<'a> Scheduler<'a> {
    /// A scheduler for a pipeline of `depth` stages holding `kv_blocks` KV blocks each.
    pub fn new(config: &'a PipelineConfig, status: &'a PipelineStatus, depth: usize, kv_blocks: usize) -> Self {
        let alloc = allocator(config, kv_blocks);
        status.kv_blocks_total.store(alloc.total() as u64, Ordering::Relaxed);
        metrics::gauge!("baton_kv_blocks_total").set(alloc.total() as f64);
        let sched = Self {
            config,
            status,
            active: Vec::new(),
            alloc,
            next_up: None,
            in_flight: VecDeque::new(),
            depth,
            batch_id: 0,
            drafter: crate::speculative::drafter(&config.speculative),
        };
        // A rebuilt pipeline starts empty: no figures left over from the one before.
        sched.publish_blocks();
        sched
    }

    /// Nothing running and nothing waiting for admission.
    pub fn is_idle(&self) -> bool {
        self.active.is_empty() && self.next_up.is_none()
    }

    /// Micro-batches sent and not answered yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Sequences admitted (holding or waiting for KV).
    #[cfg(test)]
    pub fn running(&self) -> usize {
        self.active.len()
    }

    /// Admit requests from `pull` (the queue, in arrival order) up to the running limit while
    /// their prompts' KV blocks are free beyond what admitted prompts still need; the first
    /// that does not fit waits here, the rest stay in the queue. A prompt longer than the whole
    /// pool fails at once.
    pub fn admit(&mut self, mut pull: impl FnMut() -> Option<SeqRequest>, out: &mut Outbox) {
        while self.active.len() < self.config.max_running {
            let Some(s) = self.next_up.take().or_else(&mut pull) else {
                break;
            };
            if s.queued_at.elapsed() > self.config.queue_timeout {
                let message = format!(
                    "the request waited longer than the queue timeout of {:?} for a slot; retry later",
                    self.config.queue_timeout
                );
                metrics::counter!("baton_http_limit_hits_total", "limit" => "queue_timeout").increment(1);
                refuse(s, message, true, out);
                continue;
            }
            let alloc = &self.alloc;
            // A resumed sequence is prefilled again from every token it has.
            let tokens = s.req.prompt.len() + s.resume.as_ref().map_or(0, |r| r.generated.len());
            let need = alloc.blocks_for(tokens);
            if need > alloc.total() {
                let message = format!(
                    "the sequence of {tokens} tokens needs {need} KV blocks of {} positions; the pipeline has {}",
                    alloc.block_size(),
                    alloc.total()
                );
                // A moved sequence that no longer fits (a pipeline rebuilt on fewer workers
                // holds fewer blocks) may fit again later: retriable, unlike a new prompt.
                let retriable = s.resume.is_some();
                refuse(s, message, retriable, out);
                continue;
            }
            // The whole prompt's blocks are reserved even if some are cached now: cached blocks
            // no sequence holds may be reused for others before this prompt starts.
            let pending: usize = self
                .active
                .iter()
                .filter(|q| !q.decoding())
                .map(|q| alloc.blocks_for(q.prefill_len).saturating_sub(q.blocks.len()))
                .sum();
            if !self.active.is_empty() && alloc.free() < pending + need {
                self.next_up = Some(s);
                break;
            }
            self.active.push(new_seq(s, &self.config.speculative));
        }
        self.publish_blocks();
    }

    /// Replace the drafter (tests propose what they choose).
    #[cfg(test)]
    pub fn set_drafter(&mut self, drafter: Box<dyn Drafter>) {
        self.drafter = Some(drafter);
    }

    /// Stop sequences whose requests went away and free their KV; returns the ids it stopped.
    /// One with micro-batches in flight stays (sending nothing more) until they return, so
    /// Free cannot overtake them: abort it again then.
    pub fn abort(&mut self, ids: &[u64], out: &mut Outbox) -> Vec<u64> {
        if ids.is_empty() {
            return Vec::new();
        }
        let mut stopped = Vec::new();
        if self.next_up.as_ref().is_some_and(|s| ids.contains(&s.id)) {
            let seq = new_seq(self.next_up.take().expect("checked"), &self.config.speculative);
            record_outcome(&seq, "cancelled");
            stopped.push(seq.id);
        }
        let (mut gone, kept): (Vec<Seq>, Vec<Seq>) = std::mem::take(&mut self.active)
            .into_iter()
            .partition(|s| ids.contains(&s.id) && s.in_flight == 0);
        self.active = kept;
        for s in self.active.iter_mut().filter(|s| ids.contains(&s.id)) {
            s.cancelled = true;
        }
        for s in &mut gone {
            record_outcome(s, "cancelled");
            self.alloc.release(&mut s.blocks);
            stopped.push(s.id);
        }
        out.free.extend(gone.iter().filter(|s| s.holds_kv()).map(|s| s.id));
        self.publish_blocks();
        stopped
    }

    /// Fill the free micro-batch slots: up to one micro-batch per stage in flight, over disjoint
    /// sequences, each taking an equal share of the decoding sequences and then prompt chunks up
    /// to its token budget, so every stage has work under load. When KV blocks run out, the
    /// newest sequence is preempted (recomputed later) to make room, or a lone sequence that
    /// fills the whole pool ends at its length limit.
    pub fn schedule(&mut self, out: &mut Outbox) {
        loop {
            let mut starved: Vec<u64> = Vec::new();
            let mut stalled = None;
            // Blocks admitted prompts still need (admission reserved them): proposals leave
            // them free.
            let reserved_blocks: usize = self
                .active
                .iter()
                .filter(|q| !q.decoding())
                .map(|q| self.alloc.blocks_for(q.prefill_len).saturating_sub(q.blocks.len()))
                .sum();
            while self.in_flight.len() < self.depth {
                let free = self.depth - self.in_flight.len();
                let mut idle = pick_idle(&mut self.active, self.depth, free);
                if idle.is_empty() {
                    break;
                }
                let drafting = self.drafter.as_deref_mut().map(|drafter| Drafting {
                    drafter,
                    max_context: self.config.max_context,
                    reserved_blocks,
                });
                let Composed {
                    chunks: seqs,
                    decode,
                    draft,
                    starved: short,
                    stalled: stuck,
                    prefix_queried,
                    prefix_reused,
                    snapshots,
                } = compose_step(
                    &mut idle,
                    self.config.micro_batch_tokens(),
                    &mut self.alloc,
                    drafting,
                    out,
                );
                starved.extend(short);
                stalled = stalled.or(stuck);
                if prefix_queried > 0 {
                    let st = self.status;
                    st.prefix_queried_tokens
                        .fetch_add(prefix_queried as u64, Ordering::Relaxed);
                    st.prefix_hit_tokens.fetch_add(prefix_reused as u64, Ordering::Relaxed);
                    metrics::counter!("baton_prefix_cache_queried_tokens_total").increment(prefix_queried as u64);
                    metrics::counter!("baton_prefix_cache_hit_tokens_total").increment(prefix_reused as u64);
                }
                if seqs.is_empty() {
                    break;
                }
                let members: Vec<u64> = seqs.iter().map(|c| c.seq_id).collect();
                // Proposals' K/V counts only once they are accepted (`on_result`).
                let ends: Vec<usize> = seqs
                    .iter()
                    .map(|c| c.pos0 as usize + c.tokens.len() - c.draft as usize)
                    .collect();
                self.batch_id += 1;
                let batch_id = self.batch_id;
                // Prompt chunks sent while an earlier chunk of theirs is still on a stage.
                let mut wavefront = 0;
                for s in idle.iter_mut().filter(|s| members.contains(&s.id)) {
                    wavefront += usize::from(s.in_flight > 0);
                    s.in_flight += 1;
                    s.last_batch = batch_id;
                }
                metrics::counter!("baton_wavefront_chunks_total").increment(wavefront as u64);
                let batch_tokens: usize = seqs.iter().map(|c| c.tokens.len()).sum();
                let prefill = batch_tokens - decode - draft;
                let span = step_span(batch_id, &idle, &members, batch_tokens, decode);
                span.record("wavefront_chunks", wavefront);
                span.record("prefill_tokens", prefill);
                span.record("draft_tokens", draft);
                metrics::counter!("baton_prefill_tokens_total").increment(prefill as u64);
                self.status.prompt_tokens.fetch_add(prefill as u64, Ordering::Relaxed);
                metrics::counter!("baton_decode_tokens_total").increment(decode as u64);
                metrics::histogram!("baton_step_batch_tokens").record(batch_tokens as f64);
                tracing::debug!(
                    batch_id,
                    sequences = members.len(),
                    batch_tokens,
                    in_flight = self.in_flight.len() + 1,
                    "micro-batch sent"
                );
                out.batches.push(MicroBatch {
                    batch_id,
                    seqs,
                    hidden: None,
                    trace_context: baton_shared::trace_context::inject(&span),
                    sent_unix_nanos: baton_shared::wire::unix_nanos(),
                    draft_context: None,
                    // The engine adds the sequences freed since the last batch.
                    free: Vec::new(),
                });
                metrics::counter!("baton_prefix_state_snapshots_taken_total").increment(snapshots.len() as u64);
                self.in_flight.push_back(InFlight {
                    batch_id,
                    members,
                    ends,
                    snapshots,
                    sent: Instant::now(),
                    span,
                });
                self.status
                    .max_in_flight
                    .fetch_max(self.in_flight.len() as u64, Ordering::Relaxed);
                metrics::gauge!("baton_micro_batches_in_flight").set(self.in_flight.len() as f64);
            }
            if self.in_flight.is_empty() {
                // Nothing was sent and nothing will come back: a prompt with budget but no free
                // block (admission reserves its blocks, so this is a safety net) makes room like
                // a starved decode instead of waiting for a return that will not come.
                starved.extend(stalled);
            }
            if starved.is_empty() || !self.make_room(&starved, out) {
                break;
            }
        }
        self.publish_blocks();
    }

    /// Blocks ran out for `starved` sequences: preempt a victim, or end a lone sequence that
    /// fills the pool. Whether anything changed (so composing again may get further).
    fn make_room(&mut self, starved: &[u64], out: &mut Outbox) -> bool {
        let in_flight = !self.in_flight.is_empty();
        // Nothing in flight and at most one sequence holding blocks: preempting cannot help.
        let lone = !in_flight && self.active.iter().filter(|s| !s.blocks.is_empty()).count() <= 1;
        match preemption_victim(&self.active, starved, in_flight, &self.alloc) {
            Some(i) if !lone => {
                let victim = &mut self.active[i];
                tracing::info!(
                    seq_id = victim.id,
                    tokens = victim.tokens.len(),
                    "KV blocks ran out: preempting the newest sequence"
                );
                victim.preempt(&mut self.alloc);
                self.status.preemptions.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("baton_preemptions_total").increment(1);
                self.publish_blocks();
                true
            }
            _ if !in_flight => {
                // A lone sequence has filled every block: it ends as if at its length limit.
                let (full, kept): (Vec<Seq>, Vec<Seq>) = std::mem::take(&mut self.active)
                    .into_iter()
                    .partition(|s| starved.contains(&s.id));
                self.active = kept;
                for mut s in full {
                    tracing::warn!(
                        seq_id = s.id,
                        tokens = s.tokens.len(),
                        "sequence fills the whole KV pool; finishing it"
                    );
                    record_outcome(&s, FinishReason::Length.as_str());
                    out.event(
                        s.id,
                        TokenEvent::Done {
                            reason: FinishReason::Length,
                        },
                    );
                    self.alloc.release(&mut s.blocks);
                    out.free.push(s.id);
                }
                self.publish_blocks();
                true
            }
            _ => false,
        }
    }

    /// The oldest micro-batch came back: append each sampled token to its sequence, emit it,
    /// finish sequences that stop, and index the blocks the batch filled for later prompts.
    /// A reply for any other micro-batch is an error (stages answer in order).
    pub fn on_result(&mut self, reply: BatchResult, out: &mut Outbox) -> Result<(), String> {
        let Some(done_batch) = self.in_flight.pop_front().filter(|b| b.batch_id == reply.batch_id) else {
            return Err(format!("stage 0 answered micro-batch {} out of order", reply.batch_id));
        };
        let _entered = done_batch.span.enter();
        metrics::histogram!("baton_step_seconds").record(done_batch.sent.elapsed().as_secs_f64());
        self.status.record_step(done_batch.sent.elapsed());
        metrics::gauge!("baton_micro_batches_in_flight").set(self.in_flight.len() as f64);
        for (id, end) in done_batch.members.iter().zip(&done_batch.ends) {
            if let Some(s) = self.active.iter_mut().find(|s| s.id == *id) {
                s.in_flight -= 1;
                s.landed = s.landed.max(*end);
            }
        }
        if !reply.error.is_empty() {
            // A bad batch (not a dead stage): fail its sequences, keep serving the others.
            tracing::warn!(error = %reply.error, "micro-batch failed");
            for p in &done_batch.snapshots {
                self.alloc.release_snapshot(p.snapshot);
            }
            for s in self.active.iter_mut().filter(|s| done_batch.members.contains(&s.id)) {
                if !s.failed {
                    s.failed = true;
                    record_outcome(s, "failed");
                    out.event(
                        s.id,
                        TokenEvent::Failed {
                            message: reply.error.clone(),
                            retriable: false,
                        },
                    );
                }
            }
            self.release_failed(out);
            return Ok(());
        }
        let mut finished = Vec::new();
        let method = self.drafter.as_ref().map(|d| d.method());
        for r in reply.results {
            let Some(seq) = self.active.iter_mut().find(|s| s.id == r.seq_id && !s.failed) else {
                continue;
            };
            let proposed = seq.draft.len();
            let accepted = r.more_tokens.len();
            // The stage keeps proposals only while they match its own choices, in order.
            let logprobs_missing = seq.req.logprobs && r.more_logprobs.len() != accepted;
            if !continues_draft(&seq.draft, r.token, &r.more_tokens) || logprobs_missing {
                let message = format!(
                    "the last stage answered sequence {} with {} tokens ({} with logprobs) for a draft of {proposed} that they do not continue",
                    seq.id,
                    accepted + 1,
                    r.more_logprobs.len() + 1
                );
                tracing::warn!(%message, "bad speculative result");
                seq.failed = true;
                record_outcome(seq, "failed");
                out.event(
                    seq.id,
                    TokenEvent::Failed {
                        message,
                        retriable: false,
                    },
                );
                continue;
            }
            if proposed > 0 {
                seq.pace.observe(proposed, accepted, seq.spec_tokens);
                record_verify(method, proposed, accepted, self.status);
                seq.draft.clear();
            }
            // Drafted for the positions after this answer's last token.
            seq.drafted = r.proposals;
            for (j, token) in std::iter::once(r.token).chain(r.more_tokens).enumerate() {
                seq.tokens.push(token);
                self.status.generated_tokens.fetch_add(1, Ordering::Relaxed);
                let now = Instant::now();
                match seq.last_token {
                    None => metrics::histogram!("baton_time_to_first_token_seconds")
                        .record((now - seq.submitted).as_secs_f64()),
                    Some(prev) => {
                        metrics::histogram!("baton_inter_token_latency_seconds").record((now - prev).as_secs_f64())
                    }
                }
                seq.last_token = Some(now);
                let logprobs = seq.req.logprobs.then(|| match j {
                    0 => TokenLogprobs {
                        logprob: r.logprob,
                        top: r.top_ids.iter().copied().zip(r.top_logprobs.iter().copied()).collect(),
                    },
                    // A verified draft's later tokens (their count was checked above).
                    _ => {
                        let l = &r.more_logprobs[j - 1];
                        TokenLogprobs {
                            logprob: l.logprob,
                            top: l.top_ids.iter().copied().zip(l.top_logprobs.iter().copied()).collect(),
                        }
                    }
                });
                out.event(seq.id, TokenEvent::Token { id: token, logprobs });
                if let Some(reason) = seq.finish_reason(self.config, token) {
                    // Metrics first: a client that sees Done may read /metrics at once.
                    record_outcome(seq, reason.as_str());
                    out.event(seq.id, TokenEvent::Done { reason });
                    finished.push(seq.id);
                    break;
                }
            }
            // Every token but the newest has its K/V on every stage (the accepted proposals'
            // too; the rejected ones' is dropped by the next chunk).
            seq.landed = seq.tokens.len() - 1;
        }
        // The batch's K/V is on every stage now: offer its members' full blocks to the prefix
        // index (before finished sequences release them, so they stay reusable).
        for s in self
            .active
            .iter_mut()
            .filter(|s| done_batch.members.contains(&s.id) && !s.failed)
        {
            self.alloc.index(&s.blocks, &s.tokens, s.landed, &mut s.indexed);
        }
        // Every stage has snapshotted the state at those blocks' ends.
        for p in &done_batch.snapshots {
            match self.active.iter().find(|s| s.id == p.seq_id && !s.failed) {
                Some(s) => self.alloc.attach_snapshot(&s.tokens, p.blocks, p.snapshot),
                None => self.alloc.release_snapshot(p.snapshot),
            }
        }
        for s in self.active.iter_mut().filter(|s| finished.contains(&s.id)) {
            self.alloc.release(&mut s.blocks);
        }
        self.active.retain(|s| !finished.contains(&s.id));
        out.free.extend(finished);
        self.release_failed(out);
        Ok(())
    }

    /// Release the KV of failed sequences whose chunks are all back, and drop them; then
    /// publish block usage. Called after every result, so it rebuilds the list only when
    /// there is something to drop.
    fn release_failed(&mut self, out: &mut Outbox) {
        if self.active.iter().any(|s| s.failed && s.in_flight == 0) {
            let (mut gone, kept): (Vec<Seq>, Vec<Seq>) = std::mem::take(&mut self.active)
                .into_iter()
                .partition(|s| s.failed && s.in_flight == 0);
            self.active = kept;
            for s in &mut gone {
                self.alloc.release(&mut s.blocks);
                out.free.push(s.id);
            }
        }
        self.publish_blocks();
    }

    /// The pipeline is going away (`reason`): hand back every admitted and waiting sequence,
    /// in admission order, to resume on the next one. Micro-batches in flight are forgotten
    /// (their tokens were not delivered, so they are computed again). A sequence that already
    /// moved `max_migrations` times is not moved again when `counted` (a failure, not a planned
    /// rebuild): it fails with a retriable error instead.
    pub fn evacuate(&mut self, reason: &str, counted: bool, out: &mut Outbox) -> Vec<SeqRequest> {
        let limit = self.config.max_migrations;
        let waiting = self.next_up.take();
        let mut moved = Vec::with_capacity(self.active.len() + 1);
        for s in std::mem::take(&mut self.active) {
            if counted && s.migrations >= limit {
                record_outcome(&s, "failed");
                out.event(
                    s.id,
                    TokenEvent::Failed {
                        message: format!(
                            "the pipeline broke ({reason}) and this request has already been moved to a rebuilt pipeline {limit} time(s); retry it"
                        ),
                        retriable: true,
                    },
                );
                continue;
            }
            moved.push(s.into_resumable(counted));
        }
        moved.extend(waiting);
        self.in_flight.clear();
        self.alloc = allocator(self.config, self.alloc.total());
        self.publish_blocks();
        moved
    }

    /// Publish running sequences and block usage (status for `/admin/cluster`, gauges for
    /// `/metrics`).
    fn publish_blocks(&self) {
        self.status
            .active_sequences
            .store(self.active.len() as u64, Ordering::Relaxed);
        metrics::gauge!("baton_running_sequences").set(self.active.len() as f64);
        let alloc = &self.alloc;
        let used = alloc.total() - alloc.free();
        self.status.kv_blocks_used.store(used as u64, Ordering::Relaxed);
        self.status
            .kv_blocks_cached
            .store(alloc.cached() as u64, Ordering::Relaxed);
        metrics::gauge!("baton_kv_blocks_used").set(used as f64);
        metrics::gauge!("baton_kv_blocks_cached").set(alloc.cached() as f64);
        let (snapshots_used, snapshots) = alloc.snapshots_used();
        self.status
            .state_snapshots_used
            .store(snapshots_used as u64, Ordering::Relaxed);
        self.status.state_snapshots.store(snapshots as u64, Ordering::Relaxed);
        metrics::gauge!("baton_prefix_state_snapshots_used").set(snapshots_used as f64);
    }
}

/// The block allocator of a pipeline of `kv_blocks` blocks under `config`: with state
/// snapshots for a model with recurrent state.
fn allocator(config: &PipelineConfig, kv_blocks: usize) -> BlockAllocator {
    let alloc = BlockAllocator::new(kv_blocks, config.kv_block_size, config.prefix_caching);
    match config.recurrent_state {
        true => alloc
            .with_snapshots(config.state_snapshots)
            .with_prompt_window(baton_shared::model_config::DELTA_RULE_WINDOW),
        false => alloc,
    }
}

/// A micro-batch on its way through the pipeline.
struct InFlight {
    batch_id: u64,
    members: Vec<u64>,
    /// Where each member's chunk ends: its K/V up to there is on every stage once this is back.
    ends: Vec<usize>,
    /// State snapshots its prompt chunks fill, attached to their blocks once this is back.
    snapshots: Vec<PendingSnapshot>,
    sent: Instant,
    /// `pipeline.step`, from send until its tokens are handed out.
    span: tracing::Span,
}

/// The span of one micro-batch: a child of its first sequence's span (so a lone request's
/// trace holds every stage's work) and linked to the other members' spans.
fn step_span(batch_id: u64, seqs: &[&mut Seq], members: &[u64], batch_tokens: usize, decode: usize) -> tracing::Span {
    let mut in_batch = seqs.iter().filter(|s| members.contains(&s.id));
    let first = in_batch.next().map(|s| &s.span);
    let span = tracing::info_span!(
        parent: first.and_then(|s| s.id()),
        "pipeline.step",
        batch_id,
        sequences = members.len(),
        batch_tokens,
        decode_tokens = decode,
        prefill_tokens = tracing::field::Empty,
        draft_tokens = tracing::field::Empty,
        wavefront_chunks = tracing::field::Empty,
    );
    for s in in_batch {
        // Exported as a span link.
        span.follows_from(&s.span);
    }
    span
}

impl Seq {
    /// This sequence as a request to admit on a rebuilt pipeline, with what it generated.
    fn into_resumable(self, counted: bool) -> SeqRequest {
        let generated = self.tokens[self.prompt_len..].to_vec();
        let queue_span = tracing::info_span!(parent: &self.span, "queue.wait", resumed = true);
        SeqRequest {
            id: self.id,
            submitted: self.submitted,
            req: self.req,
            span: self.span,
            queue_span,
            queued_at: Instant::now(),
            resume: Some(Resume {
                generated,
                migrations: self.migrations + u32::from(counted),
                cached_reported: self.cached_reported,
                last_token: self.last_token,
            }),
        }
    }
}

/// End a request that is not admitted, with `message`.
fn refuse(s: SeqRequest, message: String, retriable: bool, out: &mut Outbox) {
    let seq = new_seq(s, &SpeculativeConfig::OFF);
    record_outcome(&seq, "failed");
    out.event(seq.id, TokenEvent::Failed { message, retriable });
}

/// A sequence for an admitted request; it drafts with `speculative` unless the request turned
/// that off.
fn new_seq(s: SeqRequest, speculative: &SpeculativeConfig) -> Seq {
    drop(s.queue_span);
    let spec_tokens = speculative.tokens_for(s.req.params.speculative_tokens);
    let taps = spec_tokens > 0 && speculative.method == crate::speculative::DraftMethod::Dflash;
    let resume = s.resume.unwrap_or_default();
    let mut tokens = s.req.prompt.clone();
    tokens.extend_from_slice(&resume.generated);
    Seq {
        span: s.span,
        id: s.id,
        submitted: s.submitted,
        last_token: resume.last_token,
        prefilled: 0,
        in_flight: 0,
        landed: 0,
        cancelled: false,
        failed: false,
        last_batch: 0,
        migrations: resume.migrations,
        prompt_len: s.req.prompt.len(),
        prefill_len: tokens.len(),
        blocks: Vec::new(),
        reused: 0,
        indexed: IndexProgress::default(),
        restore: None,
        cached_reported: resume.cached_reported,
        tokens,
        spec_tokens,
        pace: Adaptive::new(spec_tokens),
        draft: Vec::new(),
        taps,
        drafted: Vec::new(),
        req: s.req,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(id: u64, prompt: usize, generated: usize) -> Seq {
        let tokens: Vec<u32> = (0..(prompt + generated) as u32).collect();
        let req = GenerationRequest {
            prompt: tokens[..prompt].to_vec(),
            params: baton_shared::sampling::SamplingParams::greedy(100),
            top_logprobs: 0,
            logprobs: false,
        };
        let prefilled = if generated > 0 { prompt } else { 0 };
        Seq {
            prefill_len: prompt,
            blocks: Vec::new(),
            reused: 0,
            indexed: IndexProgress::default(),
            restore: None,
            cached_reported: false,
            id,
            submitted: Instant::now(),
            last_token: None,
            tokens,
            prompt_len: prompt,
            prefilled,
            in_flight: 0,
            landed: if generated > 0 { prompt + generated - 1 } else { 0 },
            cancelled: false,
            failed: false,
            last_batch: 0,
            migrations: 0,
            spec_tokens: 0,
            pace: Adaptive::new(0),
            draft: Vec::new(),
            taps: false,
            drafted: Vec::new(),
            req,
            span: tracing::Span::none(),
        }
    }

    /// Send micro-batches over `active` as the scheduler does, returning the oldest in flight
    /// whenever all `depth` slots are taken; the sizes of the micro-batches sent.
    fn ring(active: &mut [Seq], depth: usize, in_flight: &mut VecDeque<Vec<u64>>, sends: usize) -> Vec<usize> {
        let mut sizes = Vec::new();
        let mut batch_id = active.iter().map(|s| s.last_batch).max().unwrap_or(0);
        while sizes.len() < sends {
            if in_flight.len() == depth {
                let back = in_flight.pop_front().unwrap();
                active
                    .iter_mut()
                    .filter(|s| back.contains(&s.id))
                    .for_each(|s| s.in_flight -= 1);
            }
            batch_id += 1;
            let picked: Vec<u64> = pick_idle(active, depth, depth - in_flight.len())
                .into_iter()
                .map(|s| {
                    s.in_flight += 1;
                    s.last_batch = batch_id;
                    s.id
                })
                .collect();
            sizes.push(picked.len());
            in_flight.push_back(picked);
        }
        sizes
    }

    fn pipeline_config(max_running: usize, eos: Vec<u32>) -> PipelineConfig {
        PipelineConfig {
            model: String::new(),
            num_layers: 2,
            layer_table: Default::default(),
            vocab_size: 100,
            max_context: 64,
            eos_ids: eos,
            stages: 2,
            cuts: None,
            split: crate::planner::SplitPolicy::Even,
            peer: baton_shared::auth::PeerAuth::plaintext(""),
            activation_dtype: baton_shared::proto::Dtype::F32,
            weights: "f32".into(),
            max_queue: 8,
            max_running,
            max_batch_tokens: 64,
            auto_limits: crate::pipeline::sizing::AutoLimits::NONE,
            kv_dim: 1,
            layer_caches: Vec::new(),
            kv_block_size: 16,
            kv_max_blocks: None,
            kv_dtype: baton_worker::kv_cache::KvDtype::F32,
            prefix_caching: true,
            state_snapshots: 0,
            recurrent_state: false,
            max_migrations: 2,
            queue_timeout: std::time::Duration::from_secs(60),
            live_replan: None,
            speculative: SpeculativeConfig::OFF,
        }
    }

    fn request(id: u64, prompt: Vec<u32>, max_tokens: usize) -> SeqRequest {
        SeqRequest {
            id,
            submitted: Instant::now(),
            req: GenerationRequest {
                prompt,
                params: baton_shared::sampling::SamplingParams::greedy(max_tokens),
                top_logprobs: 0,
                logprobs: false,
            },
            span: tracing::Span::none(),
            queue_span: tracing::Span::none(),
            queued_at: Instant::now(),
            resume: None,
        }
    }

    /// What a last stage would answer: `token(seq, position)` for every chunk that samples,
    /// and for a chunk with a draft, the next position's token while the proposal there
    /// equals it (as `baton_worker::backend::sample_rows` verifies).
    fn answer(batch: &MicroBatch, token: impl Fn(u64, u32) -> u32) -> BatchResult {
        let results = batch
            .seqs
            .iter()
            .filter(|c| c.sample)
            .map(|c| {
                let own = c.tokens.len() - c.draft as usize;
                let next = c.pos0 + own as u32;
                let first = token(c.seq_id, next);
                let mut more = Vec::new();
                let mut chosen = first;
                for (j, &proposal) in c.tokens[own..].iter().enumerate() {
                    if chosen != proposal {
                        break;
                    }
                    chosen = token(c.seq_id, next + 1 + j as u32);
                    more.push(chosen);
                }
                baton_shared::proto::SequenceResult {
                    seq_id: c.seq_id,
                    token: first,
                    logprob: -0.5,
                    more_logprobs: more
                        .iter()
                        .map(|&t| baton_shared::proto::TokenLogprobs {
                            logprob: -1.0 - t as f32,
                            ..Default::default()
                        })
                        .collect(),
                    more_tokens: more,
                    ..Default::default()
                }
            })
            .collect();
        BatchResult {
            batch_id: batch.batch_id,
            results,
            error: String::new(),
        }
    }

    #[test]
    fn requests_run_to_completion_through_schedule_and_results_alone() {
        // No executor, no channels: the scheduler's decisions and a stand-in last stage.
        let config = pipeline_config(4, vec![99]);
        let status = PipelineStatus::default();
        let mut sched = Scheduler::new(&config, &status, 2, 32);
        let mut out = Outbox::default();
        let mut queue = vec![request(1, (1..=5).collect(), 3), request(2, (1..=20).collect(), 8)];
        queue.reverse();
        sched.admit(|| queue.pop(), &mut out);
        assert_eq!(sched.running(), 2);
        // Sequence 2 emits EOS (99) as its third token; sequence 1 runs to max_tokens.
        let token = |seq: u64, pos: u32| if seq == 2 && pos == 22 { 99 } else { pos };
        let mut sent = VecDeque::new();
        let mut events: Vec<(u64, TokenEvent)> = Vec::new();
        let mut freed = Vec::new();
        for _ in 0..20 {
            sched.schedule(&mut out);
            sent.extend(out.batches.drain(..));
            assert!(sched.in_flight() <= 2, "one micro-batch per stage at most");
            let Some(batch) = sent.pop_front() else { break };
            sched.on_result(answer(&batch, token), &mut out).unwrap();
            events.append(&mut out.events);
            freed.append(&mut out.free);
        }
        assert!(sched.is_idle() && sent.is_empty(), "every request finished");
        let of = |id: u64| -> Vec<&TokenEvent> { events.iter().filter(|(i, _)| *i == id).map(|(_, e)| e).collect() };
        let tokens = |id| -> Vec<u32> {
            of(id)
                .iter()
                .filter_map(|e| match e {
                    TokenEvent::Token { id, .. } => Some(*id),
                    _ => None,
                })
                .collect()
        };
        assert_eq!(tokens(1), [5, 6, 7]);
        assert_eq!(
            of(1).last(),
            Some(&&TokenEvent::Done {
                reason: FinishReason::Length
            })
        );
        assert_eq!(tokens(2), [20, 21, 99]);
        assert_eq!(
            of(2).last(),
            Some(&&TokenEvent::Done {
                reason: FinishReason::Stop
            })
        );
        freed.sort();
        assert_eq!(freed, [1, 2], "both finished sequences are freed on every stage");
        assert_eq!(status.generated_tokens.load(Ordering::Relaxed), 6);
        // A reply out of order is an error, not a guess.
        let mut queue = vec![request(3, vec![1, 2], 2)];
        sched.admit(|| queue.pop(), &mut out);
        sched.schedule(&mut out);
        let batch = out.batches.pop().unwrap();
        let wrong = BatchResult {
            batch_id: batch.batch_id + 1,
            ..answer(&batch, token)
        };
        assert!(sched.on_result(wrong, &mut out).unwrap_err().contains("out of order"));
    }

    /// Run `sched` with a stand-in last stage until idle or `steps` results; the events.
    fn drive(sched: &mut Scheduler<'_>, steps: usize, out: &mut Outbox) -> Vec<(u64, TokenEvent)> {
        let token = |seq: u64, pos: u32| (seq as u32 * 7 + pos) % 50;
        let mut sent = VecDeque::new();
        let mut events = Vec::new();
        for _ in 0..steps {
            sched.schedule(out);
            sent.extend(out.batches.drain(..));
            let Some(batch) = sent.pop_front() else { break };
            sched.on_result(answer(&batch, token), out).unwrap();
            events.append(&mut out.events);
        }
        events
    }

    fn tokens_of(events: &[(u64, TokenEvent)], id: u64) -> Vec<u32> {
        events
            .iter()
            .filter(|(i, _)| *i == id)
            .filter_map(|(_, e)| match e {
                TokenEvent::Token { id, .. } => Some(*id),
                _ => None,
            })
            .collect()
    }

    /// Every chunk a sequence sends starts where its previous one ended (stages run
    /// micro-batches in the order sent, so that is the order its K/V is written in), except
    /// the first chunk of a (re)start, which starts right after its cached prefix.
    fn check_contiguous(batch: &MicroBatch, next: &mut std::collections::HashMap<u64, u32>) {
        for c in &batch.seqs {
            let restart = c.sampling.is_some();
            let at = next.entry(c.seq_id).or_insert(c.pos0);
            let want = if restart { c.cached } else { *at };
            assert_eq!(c.pos0, want, "sequence {} skipped or repeated positions", c.seq_id);
            *at = c.pos0 + c.tokens.len() as u32;
        }
    }

    /// A 2-stage scheduler (32 tokens a micro-batch, 32 blocks) running one `prompt`-token
    /// request (sequence 1), scheduled once: its first micro-batches are in `sent`.
    struct LongPrompt<'a> {
        sched: Scheduler<'a>,
        out: Outbox,
        sent: VecDeque<MicroBatch>,
    }

    /// A configuration whose context holds the long prompts of these tests.
    fn long_context_config() -> PipelineConfig {
        PipelineConfig {
            max_context: 512,
            ..pipeline_config(4, vec![])
        }
    }

    impl<'a> LongPrompt<'a> {
        fn start(config: &'a PipelineConfig, status: &'a PipelineStatus, prompt: u32) -> Self {
            let mut sched = Scheduler::new(config, status, 2, 32);
            let mut out = Outbox::default();
            let mut queue = vec![request(1, (1..=prompt).collect(), 2)];
            sched.admit(|| queue.pop(), &mut out);
            sched.schedule(&mut out);
            let sent = out.batches.drain(..).collect();
            Self { sched, out, sent }
        }

        /// The oldest micro-batch comes back (answered with each position as its token), then
        /// the scheduler fills the free slot.
        fn return_oldest(&mut self) {
            let batch = self.sent.pop_front().expect("a micro-batch in flight");
            self.sched
                .on_result(answer(&batch, |_, pos| pos), &mut self.out)
                .unwrap();
            self.sched.schedule(&mut self.out);
            self.sent.extend(self.out.batches.drain(..));
        }
    }

    #[test]
    fn a_long_prompt_has_a_chunk_on_every_stage() {
        let (config, status) = (long_context_config(), PipelineStatus::default());
        let mut lp = LongPrompt::start(&config, &status, 100);
        let chunk = |b: &MicroBatch| (b.seqs[0].pos0, b.seqs[0].tokens.len(), b.seqs[0].sample);
        // Two stages, 32 tokens a micro-batch: the first two chunks go at once.
        assert_eq!(
            lp.sent.iter().map(chunk).collect::<Vec<_>>(),
            [(0, 32, false), (32, 32, false)]
        );
        assert!(lp.sent[0].seqs[0].sampling.is_some() && lp.sent[1].seqs[0].sampling.is_none());
        // The first is back: the third enters while the second is on the last stage.
        lp.return_oldest();
        assert_eq!(chunk(&lp.sent[1]), (64, 32, false));
        // The last chunk samples; nothing follows it until its token is back.
        lp.return_oldest();
        assert_eq!(chunk(&lp.sent[1]), (96, 4, true));
        lp.return_oldest();
        assert!(
            lp.sent.len() == 1 && lp.out.events.is_empty(),
            "the first token is not back yet"
        );
        lp.return_oldest();
        assert_eq!(tokens_of(&lp.out.events, 1), [100]);
        assert_eq!(chunk(&lp.sent[0]), (100, 1, true), "then it decodes");
    }

    #[test]
    fn wavefront_chunks_keep_every_sequence_in_order_and_its_tokens_unchanged() {
        let config = PipelineConfig {
            max_running: 8,
            ..long_context_config()
        };
        let token = |seq: u64, pos: u32| (seq as u32 * 7 + pos) % 50;
        let mut alone = Vec::new();
        // 64 blocks hold everything; 12 make the newest sequences give way (preemption) while
        // the long prompt has chunks in flight.
        for (depth, blocks) in [(1, 64), (2, 64), (3, 64), (1, 12), (2, 12), (3, 12)] {
            let status = PipelineStatus::default();
            let mut sched = Scheduler::new(&config, &status, depth, blocks);
            let mut out = Outbox::default();
            let mut queue = mixed_requests();
            sched.admit(|| queue.pop(), &mut out);
            let (mut sent, mut events, mut next) = (VecDeque::new(), Vec::new(), Default::default());
            let mut most = 0;
            for _ in 0..500 {
                // As the engine does: requests waiting for blocks are admitted when they free.
                sched.admit(|| queue.pop(), &mut out);
                sched.schedule(&mut out);
                for b in out.batches.drain(..) {
                    check_contiguous(&b, &mut next);
                    sent.push_back(b);
                }
                let chunks_of_1 = sent.iter().filter(|b| b.seqs.iter().any(|c| c.seq_id == 1)).count();
                most = most.max(chunks_of_1);
                let Some(batch) = sent.pop_front() else { break };
                sched.on_result(answer(&batch, token), &mut out).unwrap();
                events.append(&mut out.events);
            }
            assert!(
                sched.is_idle(),
                "depth {depth}, {blocks} blocks: every request finished"
            );
            assert_eq!(
                most, depth,
                "depth {depth}: the long prompt had a chunk in every micro-batch"
            );
            let preempted = status.preemptions.load(Ordering::Relaxed);
            assert_eq!(
                preempted > 0,
                blocks == 12,
                "depth {depth}, {blocks} blocks: {preempted} preemptions"
            );
            let per_seq: Vec<Vec<u32>> = (1..=5).map(|id| tokens_of(&events, id)).collect();
            if depth == 1 {
                alone = per_seq;
            } else {
                assert_eq!(per_seq, alone, "depth {depth}, {blocks} blocks");
            }
        }
    }

    #[test]
    fn a_failed_chunk_releases_its_blocks_only_after_the_chunks_behind_it() {
        let (config, status) = (long_context_config(), PipelineStatus::default());
        let LongPrompt {
            mut sched,
            mut out,
            mut sent,
        } = LongPrompt::start(&config, &status, 100);
        assert_eq!(sent.len(), 2);
        let held = sched.alloc.total() - sched.alloc.free();
        let first = sent.pop_front().unwrap();
        let failed = BatchResult {
            batch_id: first.batch_id,
            results: vec![],
            error: "bad batch".into(),
        };
        sched.on_result(failed, &mut out).unwrap();
        assert!(
            matches!(out.events[..], [(1, TokenEvent::Failed { .. })]),
            "told at once"
        );
        out.events.clear();
        assert!(out.free.is_empty(), "its second chunk is still on a stage");
        assert_eq!(
            sched.alloc.total() - sched.alloc.free(),
            held,
            "blocks kept until it is back"
        );
        let mut lp = LongPrompt { sched, out, sent };
        lp.return_oldest();
        assert!(lp.sent.is_empty(), "nothing more is sent for it");
        assert!(lp.out.events.is_empty(), "no token after the failure");
        assert_eq!(lp.out.free, [1]);
        assert_eq!(lp.sched.alloc.free(), lp.sched.alloc.total());
        assert!(lp.sched.is_idle());
    }

    #[test]
    fn a_cancelled_prompt_sends_no_more_chunks_and_is_freed_when_they_are_back() {
        let (config, status) = (long_context_config(), PipelineStatus::default());
        let mut lp = LongPrompt::start(&config, &status, 100);
        assert!(lp.sched.abort(&[1], &mut lp.out).is_empty(), "chunks are in flight");
        lp.return_oldest();
        assert_eq!(lp.sent.len(), 1, "no chunk follows a cancelled prompt's");
        assert!(
            lp.sched.abort(&[1], &mut lp.out).is_empty(),
            "one chunk is still in flight"
        );
        lp.return_oldest();
        assert_eq!(lp.sched.abort(&[1], &mut lp.out), [1]);
        assert_eq!(lp.out.free, [1]);
        assert_eq!(lp.sched.alloc.free(), lp.sched.alloc.total());
    }

    #[test]
    fn only_chunks_that_came_back_are_offered_to_the_prefix_cache() {
        let (config, status) = (long_context_config(), PipelineStatus::default());
        let mut lp = LongPrompt::start(&config, &status, 64);
        assert_eq!(lp.sent.len(), 2);
        lp.return_oldest();
        // Positions 32..64 are still on their way: a second prompt reuses only the first 32.
        let mut queue = vec![request(2, (1..=64).chain([7, 8, 9]).collect(), 2)];
        lp.sched.admit(|| queue.pop(), &mut lp.out);
        lp.sched.schedule(&mut lp.out);
        let second = lp
            .out
            .batches
            .iter()
            .flat_map(|b| &b.seqs)
            .find(|c| c.seq_id == 2)
            .unwrap();
        assert_eq!((second.pos0, second.cached), (32, 32));
    }

    #[test]
    fn evacuated_sequences_resume_on_a_new_scheduler_with_the_same_tokens() {
        let config = pipeline_config(4, vec![]);
        let requests = || vec![request(2, (1..=20).collect(), 9), request(1, (1..=5).collect(), 12)];
        let status = PipelineStatus::default();
        // Undisturbed.
        let mut sched = Scheduler::new(&config, &status, 2, 32);
        let mut out = Outbox::default();
        let mut queue = requests();
        sched.admit(|| queue.pop(), &mut out);
        let whole = drive(&mut sched, 100, &mut out);
        // Broken after 5 results: the rest comes from a new scheduler (a rebuilt pipeline).
        let mut sched = Scheduler::new(&config, &status, 2, 32);
        let mut queue = requests();
        sched.admit(|| queue.pop(), &mut out);
        let mut events = drive(&mut sched, 5, &mut out);
        let moved = sched.evacuate("stage 1 died", true, &mut out);
        assert!(sched.is_idle() && sched.in_flight() == 0);
        assert_eq!(
            moved.iter().map(|s| s.id).collect::<Vec<_>>(),
            [1, 2],
            "admission order"
        );
        let mut sched = Scheduler::new(&config, &status, 3, 32);
        let mut moved: VecDeque<_> = moved.into();
        sched.admit(|| moved.pop_front(), &mut out);
        // The first chunk of a resumed sequence carries the prefix it recomputes and how many
        // tokens its sampler already drew.
        sched.schedule(&mut out);
        let first = &out.batches[0].seqs[0];
        let resumed = tokens_of(&events, first.seq_id).len();
        assert!(resumed > 0);
        assert_eq!(first.sampling.as_ref().unwrap().drawn as usize, resumed);
        events.extend(drive(&mut sched, 100, &mut out));
        for id in [1, 2] {
            assert_eq!(tokens_of(&events, id), tokens_of(&whole, id), "sequence {id}");
        }
        let done = |ev: &[(u64, TokenEvent)]| ev.iter().filter(|(_, e)| matches!(e, TokenEvent::Done { .. })).count();
        assert_eq!(done(&events), 2);
    }

    #[test]
    fn a_sequence_moved_too_often_fails_retriably_but_planned_moves_are_free() {
        let config = pipeline_config(4, vec![]);
        let status = PipelineStatus::default();
        let mut out = Outbox::default();
        let mut moved: VecDeque<_> = vec![request(1, (1..=5).collect(), 40)].into();
        // Two planned rebuilds, then max_migrations (2) failures move it; the next one ends it.
        for (counted, survives) in [(false, true), (false, true), (true, true), (true, true), (true, false)] {
            let mut sched = Scheduler::new(&config, &status, 2, 32);
            sched.admit(|| moved.pop_front(), &mut out);
            drive(&mut sched, 3, &mut out);
            out.events.clear();
            moved = sched.evacuate("a stage died", counted, &mut out).into();
            assert_eq!(moved.len() == 1, survives);
        }
        match &out.events[..] {
            [
                (
                    1,
                    TokenEvent::Failed {
                        message,
                        retriable: true,
                    },
                ),
            ] => {
                assert!(
                    message.contains("a stage died") && message.contains("2 time"),
                    "{message}"
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_request_past_the_queue_timeout_fails_retriably_at_admission() {
        let config = PipelineConfig {
            queue_timeout: std::time::Duration::ZERO,
            ..pipeline_config(4, vec![])
        };
        let status = PipelineStatus::default();
        let mut sched = Scheduler::new(&config, &status, 2, 32);
        let mut out = Outbox::default();
        let mut queue = vec![request(1, vec![1, 2], 4)];
        std::thread::sleep(std::time::Duration::from_millis(2));
        sched.admit(|| queue.pop(), &mut out);
        assert!(sched.is_idle());
        assert!(
            matches!(&out.events[..], [(1, TokenEvent::Failed { retriable: true, message })] if message.contains("queue timeout"))
        );
    }

    #[test]
    fn an_aborted_request_is_freed_once_its_micro_batch_is_back() {
        let config = pipeline_config(4, vec![]);
        let status = PipelineStatus::default();
        let mut sched = Scheduler::new(&config, &status, 1, 32);
        let mut out = Outbox::default();
        let mut queue = vec![request(7, (1..=4).collect(), 10)];
        sched.admit(|| queue.pop(), &mut out);
        sched.schedule(&mut out);
        let batch = out.batches.pop().unwrap();
        assert!(
            sched.abort(&[7], &mut out).is_empty(),
            "its micro-batch is still in flight"
        );
        assert!(out.free.is_empty());
        assert_eq!(sched.running(), 1);
        sched.on_result(answer(&batch, |_, p| p), &mut out).unwrap();
        out.events.clear();
        assert_eq!(sched.abort(&[7], &mut out), [7]);
        assert_eq!(out.free, [7]);
        assert!(sched.is_idle());
        assert_eq!(status.kv_blocks_used.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn an_uneven_split_of_micro_batches_evens_out_on_the_next_return() {
        // 16 decoding sequences split 9/7 over two micro-batches, as arrivals can leave them:
        // the first 9 are back, the other 7 in flight.
        let mut active: Vec<Seq> = (0..16).map(|i| seq(i, 4, 1)).collect();
        for s in &mut active[..9] {
            s.last_batch = 1;
        }
        for s in &mut active[9..] {
            s.last_batch = 2;
            s.in_flight = 1;
        }
        let mut in_flight = VecDeque::from([(9..16).collect::<Vec<u64>>()]);
        let sizes = ring(&mut active, 2, &mut in_flight, 6);
        assert_eq!(sizes, [8; 6], "the 9 go back as 8, and the one left behind joins the 7");
        // Every sequence went in one of every two micro-batches: none was left behind twice.
        let mut sent = [0usize; 16];
        for s in &active {
            sent[s.id as usize] = s.last_batch as usize;
        }
        assert!(
            sent.iter().all(|&b| b >= 7),
            "last micro-batch of each sequence: {sent:?}"
        );
        // One stage: every idle sequence goes at once.
        active.iter_mut().for_each(|s| s.in_flight = 0);
        assert_eq!(ring(&mut active, 1, &mut VecDeque::new(), 1), [16]);
        // Fewer sequences than an even split needs: every stage still gets a micro-batch.
        let mut four: Vec<Seq> = (0..4).map(|i| seq(i, 4, 1)).collect();
        assert_eq!(ring(&mut four, 3, &mut VecDeque::new(), 6), [2, 1, 1, 2, 1, 1]);
    }

    #[test]
    fn a_capped_micro_batch_keeps_decodes_before_prompts() {
        // 7 decoding sequences and 1 new prompt idle, 8 in flight: all go, decodes first.
        let mut active: Vec<Seq> = (0..16).map(|i| seq(i, 4, 1)).collect();
        for s in &mut active[8..] {
            s.in_flight = 1;
        }
        active[0] = seq(0, 4, 0);
        let first: Vec<u64> = pick_idle(&mut active, 2, 1).iter().map(|s| s.id).collect();
        assert_eq!(first, [1, 2, 3, 4, 5, 6, 7, 0], "decodes first, then the prompt");
        // 14 decoding over 2 stages, 6 of them in flight: the share is 7 decodes (the one left
        // behind goes next), and both idle prompts come after them, outside the share.
        for s in &mut active[14..] {
            s.in_flight = 0;
        }
        active[14] = seq(14, 4, 0);
        let picked: Vec<u64> = pick_idle(&mut active, 2, 1).iter().map(|s| s.id).collect();
        assert_eq!(picked, [1, 2, 3, 4, 5, 6, 7, 0, 14]);
    }

    #[test]
    fn prompt_chunks_fill_every_micro_batch_not_only_the_one_short_of_decodes() {
        // 14 decoding and 2 prompts of 200 tokens over 2 stages, nothing in flight. Capped by
        // count (8 a micro-batch), the first took 8 decodes and the second 6 decodes and the
        // prompt chunks: 8 tokens against 64. Now both carry 7 decodes and fill their budget.
        let mut active: Vec<Seq> = (0..16).map(|i| seq(i, 4, 1)).collect();
        active[3] = seq(3, 200, 0);
        active[9] = seq(9, 200, 0);
        let mut alloc = BlockAllocator::new(1 << 20, 16, true);
        let mut tokens = Vec::new();
        for batch_id in 1..=2 {
            let mut idle = pick_idle(&mut active, 2, 3 - batch_id as usize);
            let c = compose_step(&mut idle, 64, &mut alloc, None, &mut Outbox::default());
            assert_eq!(c.decode, 7, "micro-batch {batch_id}: an equal share of the decodes");
            let members: Vec<u64> = c.chunks.iter().map(|c| c.seq_id).collect();
            for s in idle.iter_mut().filter(|s| members.contains(&s.id)) {
                s.in_flight += 1;
                s.last_batch = batch_id;
            }
            tokens.push(c.chunks.iter().map(|c| c.tokens.len()).sum::<usize>());
        }
        assert_eq!(tokens, [64, 64], "both micro-batches fill the step's budget");
    }

    /// Compose over every sequence, as the scheduler does when nothing is in flight.
    fn compose_all(active: &mut [Seq], budget: usize) -> (Vec<SequenceChunk>, usize) {
        let mut alloc = BlockAllocator::new(1 << 20, 16, true);
        let mut all: Vec<&mut Seq> = active.iter_mut().collect();
        let c = compose_step(&mut all, budget, &mut alloc, None, &mut Outbox::default());
        assert!(c.starved.is_empty());
        (c.chunks, c.decode)
    }

    #[test]
    fn chunks_get_blocks_and_shrink_to_the_blocks_there_are() {
        // 4 blocks of 16: one decoding sequence at 31 tokens (2 blocks held after this step),
        // one 100-token prompt that can take the remaining 2 blocks (32 positions).
        let mut alloc = BlockAllocator::new(4, 16, true);
        let mut active = vec![seq(1, 20, 11), seq(2, 100, 0)];
        assert!(alloc.cover(&mut active[0].blocks, 30));
        let mut all: Vec<&mut Seq> = active.iter_mut().collect();
        let c = compose_step(&mut all, 512, &mut alloc, None, &mut Outbox::default());
        assert_eq!(c.decode, 1);
        assert_eq!(c.chunks[0].blocks.len(), 2, "position 30 fits the second block");
        assert_eq!(c.chunks[1].tokens.len(), 32, "the prompt chunk shrank to two blocks");
        assert_eq!(c.chunks[1].blocks.len(), 2);
        assert!(!c.chunks[1].sample);
        assert_eq!(alloc.free(), 0);
        // Next step: the decoding sequence needs a third block at position 32; none is free.
        active[0].tokens.push(7);
        active[0].tokens.push(8);
        let mut all: Vec<&mut Seq> = active.iter_mut().collect();
        let c = compose_step(&mut all, 512, &mut alloc, None, &mut Outbox::default());
        assert_eq!(c.starved, [1]);
        assert!(c.chunks.is_empty(), "the prompt waits too: no block");
        // The newest sequence is the victim; after preemption it prefills all its tokens again.
        let victim = preemption_victim(&active, &c.starved, false, &alloc).unwrap();
        assert_eq!(active[victim].id, 2);
        active[victim].preempt(&mut alloc);
        assert_eq!(alloc.free(), 2);
        assert_eq!((active[1].prefilled, active[1].prefill_len), (0, 100));
        // While batches are in flight, a starved sequence is not its own victim.
        let only = vec![seq(3, 5, 40)];
        assert_eq!(preemption_victim(&only, &[3], true, &alloc), None);
    }

    #[test]
    fn prompts_holding_every_block_stall_and_the_newest_makes_room() {
        let mut alloc = BlockAllocator::new(2, 16, true);
        let mut active = vec![seq(1, 40, 0), seq(2, 40, 0)];
        for s in &mut active {
            assert!(alloc.cover(&mut s.blocks, 16));
            s.prefilled = 16;
        }
        let mut all: Vec<&mut Seq> = active.iter_mut().collect();
        let c = compose_step(&mut all, 512, &mut alloc, None, &mut Outbox::default());
        assert!(c.chunks.is_empty());
        assert_eq!(c.stalled, Some(1), "the oldest prompt has budget and no block");
        let victim = preemption_victim(&active, &[1], false, &alloc).unwrap();
        assert_eq!(active[victim].id, 2);
    }

    #[test]
    fn the_victim_is_one_whose_release_frees_a_block() {
        let mut alloc = BlockAllocator::new(6, 16, true);
        // Sequence 1 computed two full blocks; sequence 3 (newest) holds only those, shared.
        let mut active = vec![seq(1, 32, 1), seq(2, 20, 1), seq(3, 40, 0)];
        assert!(alloc.cover(&mut active[0].blocks, 33));
        let (t, tokens) = (active[0].blocks.clone(), active[0].tokens.clone());
        alloc.index(&t, &tokens, 32, &mut active[0].indexed);
        assert!(alloc.cover(&mut active[1].blocks, 21));
        active[2].tokens[..32].copy_from_slice(&tokens[..32]);
        let prompt3 = active[2].tokens.clone();
        assert_eq!(alloc.take_prefix(&mut active[2].blocks, &prompt3), 32);
        assert!(!alloc.frees_any(&active[2].blocks));
        let victim = preemption_victim(&active, &[1], false, &alloc).unwrap();
        assert_eq!(active[victim].id, 2, "the newest frees nothing; the next one does");
    }

    #[test]
    fn a_cached_prefix_starts_the_first_chunk_after_it() {
        let mut alloc = BlockAllocator::new(8, 16, true);
        // An earlier sequence computed 40 tokens; a new one shares its first 36.
        let mut old = seq(1, 40, 0);
        old.tokens = (100..140).collect();
        assert!(alloc.cover(&mut old.blocks, 40));
        let mut progress = IndexProgress::default();
        alloc.index(&old.blocks, &old.tokens, 40, &mut progress);
        let mut new = seq(2, 50, 0);
        new.tokens[..36].copy_from_slice(&old.tokens[..36]);
        new.req.prompt = new.tokens.clone();
        let mut all = vec![&mut new];
        let c = compose_step(&mut all, 512, &mut alloc, None, &mut Outbox::default());
        assert_eq!((c.prefix_queried, c.prefix_reused), (50, 32));
        let chunk = &c.chunks[0];
        assert_eq!((chunk.pos0, chunk.cached, chunk.tokens.len()), (32, 32, 18));
        assert_eq!(chunk.blocks[..2], old.blocks[..2]);
        assert!(chunk.sampling.is_some() && chunk.sample);
        // Preempted and restarted, it looks the prefix up again, its own blocks included.
        new.in_flight = 0;
        new.tokens.push(7);
        let tokens = new.tokens.clone();
        alloc.index(&new.blocks, &tokens, 50, &mut new.indexed);
        new.preempt(&mut alloc);
        let mut all = vec![&mut new];
        let c = compose_step(&mut all, 512, &mut alloc, None, &mut Outbox::default());
        assert_eq!((c.chunks[0].pos0, c.chunks[0].cached), (48, 48));
        assert_eq!(c.chunks[0].tokens, [tokens[48], tokens[49], 7]);
    }

    #[test]
    fn hybrid_chunks_end_on_block_boundaries_where_the_state_can_be_snapshotted() {
        // (prefilled, n, prefill_len, block 16) -> tokens taken.
        assert_eq!(
            snapshot_aligned(0, 25, 100, 16),
            16,
            "cut back to the boundary it reaches"
        );
        assert_eq!(snapshot_aligned(16, 25, 100, 16), 16);
        assert_eq!(snapshot_aligned(0, 10, 100, 16), 10, "no boundary reached: as it is");
        assert_eq!(snapshot_aligned(0, 32, 100, 16), 32, "already on one");
        assert_eq!(
            snapshot_aligned(48, 22, 70, 16),
            16,
            "a 4-block prompt's last full block first"
        );
        assert_eq!(snapshot_aligned(64, 6, 70, 16), 6, "then the tail");
        assert_eq!(
            snapshot_aligned(32, 18, 50, 16),
            18,
            "a shorter prompt ends in one piece"
        );
    }

    #[test]
    fn hybrid_prompt_chunks_end_on_delta_rule_windows() {
        // (prefilled, n, windowed end, window 16, most) -> tokens taken.
        assert_eq!(
            window_aligned(0, 25, 96, 16, 100),
            16,
            "cut back to the window it reaches"
        );
        assert_eq!(window_aligned(16, 40, 96, 16, 100), 32);
        assert_eq!(window_aligned(0, 32, 96, 16, 100), 32, "already on one");
        assert_eq!(window_aligned(32, 5, 96, 16, 100), 16, "stretched to the next one");
        assert_eq!(window_aligned(32, 5, 96, 16, 10), 0, "unless there is no room for it");
        assert_eq!(window_aligned(80, 9, 96, 16, 100), 16);
        assert_eq!(
            window_aligned(80, 30, 96, 16, 100),
            30,
            "past the last whole window: as it is"
        );
        assert_eq!(window_aligned(96, 3, 96, 16, 100), 3, "the tail");
        assert_eq!(window_aligned(0, 0, 96, 16, 100), 0);
        assert_eq!(
            (lcm(16, 16), lcm(8, 16), lcm(32, 16), lcm(12, 16), lcm(1, 16)),
            (16, 16, 32, 48, 16)
        );

        // Through compose_step: a decoding sequence takes most of a 6-token budget, and the
        // prompt's chunk is stretched to a whole window rather than cut mid-window.
        let mut alloc = BlockAllocator::new(64, 16, false).with_prompt_window(16);
        let mut busy = seq(1, 4, 1);
        assert!(alloc.cover(&mut busy.blocks, 5));
        let mut long = seq(2, 70, 0);
        let mut steps = Vec::new();
        while long.prefilled < long.prefill_len {
            let mut all = vec![&mut busy, &mut long];
            let c = compose_step(&mut all, 6, &mut alloc, None, &mut Outbox::default());
            let chunk = c.chunks.iter().find(|c| c.seq_id == 2).unwrap();
            assert_eq!(chunk.prompt_len, 70);
            steps.push((chunk.pos0, chunk.tokens.len()));
        }
        assert_eq!(steps, [(0, 16), (16, 16), (32, 16), (48, 16), (64, 5), (69, 1)]);
    }

    /// A stage of a hybrid model reduced to what the protocol must keep right: each
    /// sequence's recurrent state as the tokens it has absorbed, and the snapshots.
    #[derive(Default)]
    struct FakeRecurrentStage {
        states: std::collections::HashMap<u64, Vec<u32>>,
        snapshots: std::collections::HashMap<u32, Vec<u32>>,
        restores: usize,
    }

    /// A 2-stage pipeline's configuration for a hybrid model with `snapshots` state snapshots.
    fn hybrid_config(max_running: usize, max_batch_tokens: usize, snapshots: usize) -> PipelineConfig {
        PipelineConfig {
            max_context: 512,
            max_batch_tokens,
            recurrent_state: true,
            state_snapshots: snapshots,
            ..pipeline_config(max_running, vec![])
        }
    }

    impl FakeRecurrentStage {
        /// Admit from `queue`, schedule and answer micro-batches in order (each run through
        /// this stage when sent) until nothing is in flight; the events.
        fn drive(
            &mut self,
            sched: &mut Scheduler<'_>,
            queue: &mut VecDeque<SeqRequest>,
            out: &mut Outbox,
        ) -> Vec<(u64, TokenEvent)> {
            let token = |seq: u64, pos: u32| (seq as u32 * 7 + pos) % 50 + 200;
            let (mut events, mut sent) = (Vec::new(), VecDeque::new());
            for _ in 0..2000 {
                sched.admit(|| queue.pop_front(), out);
                sched.schedule(out);
                for b in out.batches.drain(..) {
                    self.run(&b);
                    sent.push_back(b);
                }
                let Some(batch) = sent.pop_front() else { break };
                sched.on_result(answer(&batch, token), out).unwrap();
                events.append(&mut out.events);
            }
            events
        }

        fn run(&mut self, batch: &MicroBatch) {
            for c in &batch.seqs {
                if c.pos0 == 0 || c.cached != 0 {
                    let start = match c.restore_state {
                        Some(s) => {
                            self.restores += 1;
                            self.snapshots[&s].clone()
                        }
                        None => Vec::new(),
                    };
                    assert_eq!(start.len(), c.cached as usize, "sequence {}: restored state", c.seq_id);
                    self.states.insert(c.seq_id, start);
                }
                let state = self.states.get_mut(&c.seq_id).unwrap();
                assert_eq!(
                    state.len(),
                    c.pos0 as usize,
                    "sequence {}: state and position",
                    c.seq_id
                );
                // Below a prompt's last whole delta-rule window, chunks start and end on
                // window boundaries (what keeps the stages' bits independent of the schedule).
                let windowed = c.prompt_len as usize / 16 * 16;
                let end = c.pos0 as usize + c.tokens.len();
                if (c.pos0 as usize) < windowed {
                    assert_eq!(c.pos0 % 16, 0, "sequence {}: a windowed chunk's start", c.seq_id);
                    assert!(
                        end.is_multiple_of(16) || end >= windowed,
                        "sequence {}: chunk ends at {end}",
                        c.seq_id
                    );
                }
                state.extend(&c.tokens);
                if let Some(s) = c.save_state {
                    assert_eq!(state.len() % 16, 0, "snapshots are taken on block boundaries");
                    assert!(
                        state.len() <= windowed,
                        "a snapshot at {} is past the windows",
                        state.len()
                    );
                    self.snapshots.insert(s, state.clone());
                }
            }
        }
    }

    #[test]
    fn hybrid_prefix_hits_start_from_a_snapshot_of_exactly_the_reused_tokens() {
        // Three prompts that share 50 tokens and a fourth equal to the first, one after another
        // through a 2-stage scheduler: every restored state must be the state of exactly the
        // reused tokens, and every sequence's final state that of all its tokens.
        let config = hybrid_config(4, 50, 8);
        let status = PipelineStatus::default();
        let mut sched = Scheduler::new(&config, &status, 2, 64);
        let mut out = Outbox::default();
        let shared: Vec<u32> = (1..=50).collect();
        let prompts = [
            [&shared[..], &[60, 61, 62, 63, 64][..]].concat(),
            [&shared[..], &[70; 30][..]].concat(),
            [&shared[..], &[80, 81][..]].concat(),
        ];
        let mut stage = FakeRecurrentStage::default();
        for (i, prompt) in prompts.iter().chain([&prompts[0]]).enumerate() {
            let mut queue = VecDeque::from([request(i as u64 + 1, prompt.clone(), 4)]);
            let events = stage.drive(&mut sched, &mut queue, &mut out);
            assert!(sched.is_idle());
            let generated = tokens_of(&events, i as u64 + 1);
            assert_eq!(generated.len(), 4);
            // The last token is sampled, not yet absorbed.
            let full = [&prompt[..], &generated[..3]].concat();
            assert_eq!(stage.states[&(i as u64 + 1)], full, "sequence {}", i + 1);
        }
        // The first prompt's chunks end at 16 and 32 (the 25-token budget cut back to block
        // boundaries), then at its end (55: a 3-block prompt is not cut before its tail), so
        // the second starts from 32. It recomputes block 2 (positions 32..48) as a twin of the
        // first's and snapshots its end there, so the third and the repeat start from 48.
        assert_eq!(stage.restores, 3);
        assert_eq!(status.prefix_hit_tokens.load(Ordering::Relaxed), 32 + 48 + 48);
        let (used, total) = sched.alloc.snapshots_used();
        assert!(used > 0 && used <= total);
    }

    #[test]
    fn preempted_hybrid_sequences_resume_from_snapshots_of_their_own_tokens() {
        // Eight 40-token prompts from two stems at once in a pool of 14 blocks: sequences are
        // preempted, and restart from the snapshots their own chunks (or a twin's) left; every
        // restored state is that of exactly the reused tokens and every final state that of
        // all the sequence's tokens.
        let config = hybrid_config(8, 64, 16);
        let status = PipelineStatus::default();
        let mut sched = Scheduler::new(&config, &status, 2, 14);
        let mut out = Outbox::default();
        let prompts: Vec<Vec<u32>> = (0..8u32)
            .map(|i| {
                (0..40)
                    .map(|p| if p < 24 { (i % 2) * 100 + p } else { i * 1000 + p })
                    .collect()
            })
            .collect();
        let mut queue: VecDeque<SeqRequest> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| request(i as u64 + 1, p.clone(), 20))
            .collect();
        let mut stage = FakeRecurrentStage::default();
        let events = stage.drive(&mut sched, &mut queue, &mut out);
        assert!(sched.is_idle() && queue.is_empty());
        for (i, prompt) in prompts.iter().enumerate() {
            let id = i as u64 + 1;
            let generated = tokens_of(&events, id);
            assert_eq!(generated.len(), 20, "sequence {id}");
            assert_eq!(
                stage.states[&id],
                [&prompt[..], &generated[..19]].concat(),
                "sequence {id}"
            );
        }
        let preempted = status.preemptions.load(Ordering::Relaxed);
        assert!(
            preempted > 0 && stage.restores > 0,
            "{preempted} preemptions, {} restores",
            stage.restores
        );
    }

    #[test]
    fn a_prefix_is_not_taken_when_no_block_would_be_left_for_the_rest() {
        let mut alloc = BlockAllocator::new(3, 16, true);
        let mut old = seq(1, 32, 0);
        assert!(alloc.cover(&mut old.blocks, 32));
        alloc.index(&old.blocks, &old.tokens, 32, &mut old.indexed);
        alloc.release(&mut old.blocks);
        // A decoding sequence holds the third block; the two cached ones are idle.
        let mut busy = seq(2, 4, 1);
        assert!(alloc.cover(&mut busy.blocks, 5));
        let mut new = seq(3, 40, 0);
        new.tokens[..32].copy_from_slice(&old.tokens);
        let mut all = vec![&mut busy, &mut new];
        let c = compose_step(&mut all, 512, &mut alloc, None, &mut Outbox::default());
        let chunk = c.chunks.iter().find(|c| c.seq_id == 3).unwrap();
        assert_eq!((chunk.pos0, chunk.cached, chunk.tokens.len()), (0, 0, 32));
        assert_eq!((c.prefix_queried, c.prefix_reused), (40, 0));
        assert_eq!(
            alloc.cached(),
            0,
            "the idle cached blocks were taken for its own positions"
        );
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

    /// Proposes exactly what the stand-in stages of these tests choose next: each generated
    /// token is the one before it plus one (mod 50).
    struct Oracle;

    impl Drafter for Oracle {
        fn method(&self) -> crate::speculative::DraftMethod {
            crate::speculative::DraftMethod::Ngram
        }

        fn propose(&mut self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
            let last = *tokens.last().expect("a decoding sequence has tokens");
            out.extend((1..=k as u32).map(|i| (last + i) % 50));
        }
    }

    /// Proposes tokens the stand-in stages never choose.
    struct Wrong;

    impl Drafter for Wrong {
        fn method(&self) -> crate::speculative::DraftMethod {
            crate::speculative::DraftMethod::Ngram
        }

        fn propose(&mut self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
            let last = *tokens.last().expect("a decoding sequence has tokens");
            out.extend(std::iter::repeat_n((last + 2) % 50, k));
        }
    }

    fn speculative_config(k: usize) -> PipelineConfig {
        PipelineConfig {
            max_running: 8,
            speculative: SpeculativeConfig::new(crate::speculative::DraftMethod::Ngram, k),
            ..long_context_config()
        }
    }

    /// Mixed prompts (one long enough for a wavefront) and output lengths, queued in order.
    fn mixed_requests() -> Vec<SeqRequest> {
        let mut q: Vec<SeqRequest> = [(1, 150, 20), (2, 7, 30), (3, 70, 4), (4, 33, 40), (5, 1, 30)]
            .into_iter()
            .map(|(id, len, max)| request(id, (0..len).map(|t| (t * 3 + id as u32) % 50).collect(), max))
            .collect();
        q.reverse();
        q
    }

    /// Run the mixed workload to the end over `depth` stages and `blocks` KV blocks with
    /// `drafter` (None: the configuration's, or none), checking every chunk starts where its
    /// sequence's accepted tokens end; each sequence's tokens.
    fn run_mixed(
        config: &PipelineConfig,
        status: &PipelineStatus,
        depth: usize,
        blocks: usize,
        drafter: Option<Box<dyn Drafter>>,
    ) -> Vec<Vec<u32>> {
        let token = |seq: u64, pos: u32| (seq as u32 * 7 + pos) % 50;
        let mut sched = Scheduler::new(config, status, depth, blocks);
        if let Some(d) = drafter {
            sched.set_drafter(d);
        }
        let mut out = Outbox::default();
        let mut queue = mixed_requests();
        let (mut sent, mut events) = (VecDeque::new(), Vec::new());
        // Per sequence: where its next chunk may start (its accepted tokens' end) and how many
        // proposals past that its previous chunk wrote.
        let mut next: std::collections::HashMap<u64, (u32, u32)> = Default::default();
        for _ in 0..2000 {
            sched.admit(|| queue.pop(), &mut out);
            sched.schedule(&mut out);
            for b in out.batches.drain(..) {
                for c in &b.seqs {
                    assert!(c.draft == 0 || c.sample, "only sampling chunks carry proposals");
                    let (at, written) = next.get(&c.seq_id).copied().unwrap_or((c.pos0, 0));
                    let start = if c.sampling.is_some() { c.cached } else { c.pos0 };
                    if c.sampling.is_none() {
                        assert!(
                            (at..=at + written).contains(&c.pos0),
                            "sequence {} starts at {} after {at} + {written} proposals",
                            c.seq_id,
                            c.pos0
                        );
                    }
                    assert!(
                        c.pos0 as usize + c.tokens.len() <= config.max_context,
                        "inside the context"
                    );
                    next.insert(c.seq_id, (start.max(c.pos0) + c.tokens.len() as u32 - c.draft, c.draft));
                }
                sent.push_back(b);
            }
            let Some(batch) = sent.pop_front() else { break };
            let reply = answer(&batch, token);
            for (c, r) in batch.seqs.iter().filter(|c| c.sample).zip(&reply.results) {
                // The accepted proposals' K/V stays: the next chunk may start after them.
                if let Some(e) = next.get_mut(&c.seq_id) {
                    e.0 += r.more_tokens.len() as u32;
                    e.1 -= r.more_tokens.len() as u32;
                }
            }
            sched.on_result(reply, &mut out).unwrap();
            events.append(&mut out.events);
        }
        assert!(sched.is_idle(), "every request finished");
        (1..=5).map(|id| tokens_of(&events, id)).collect()
    }

    #[test]
    fn speculative_decoding_changes_no_token_at_any_depth_with_or_without_preemption() {
        let plain_config = long_context_config();
        let plain_config = PipelineConfig {
            max_running: 8,
            ..plain_config
        };
        let alone = run_mixed(&plain_config, &PipelineStatus::default(), 1, 64, None);
        let config = speculative_config(4);
        for (depth, blocks) in [(1, 64), (2, 64), (3, 64), (1, 12), (2, 12), (3, 12)] {
            let case = format!("depth {depth}, {blocks} blocks");
            let status = PipelineStatus::default();
            let got = run_mixed(&config, &status, depth, blocks, Some(Box::new(Oracle)));
            assert_eq!(got, alone, "{case}, oracle drafter");
            let (steps, proposed, accepted) = (
                status.spec_steps.load(Ordering::Relaxed),
                status.spec_proposed_tokens.load(Ordering::Relaxed),
                status.spec_accepted_tokens.load(Ordering::Relaxed),
            );
            assert!(steps > 0 && accepted == proposed, "{case}: every proposal accepted");
            // Budget and blocks may cut a draft short, but most steps carry several.
            assert!(proposed >= 2 * steps, "{case}: {proposed} proposed in {steps} steps");

            let status = PipelineStatus::default();
            let got = run_mixed(&config, &status, depth, blocks, Some(Box::new(Wrong)));
            assert_eq!(got, alone, "{case}, wrong drafter");
            let (steps, proposed, accepted) = (
                status.spec_steps.load(Ordering::Relaxed),
                status.spec_proposed_tokens.load(Ordering::Relaxed),
                status.spec_accepted_tokens.load(Ordering::Relaxed),
            );
            assert_eq!(accepted, 0, "{case}");
            // 115 decode steps in all; after two misses a sequence pauses, longer each time.
            assert!(
                steps < 40 && proposed < 60,
                "{case}: backs off ({steps} steps, {proposed} proposed)"
            );

            let status = PipelineStatus::default();
            assert_eq!(
                run_mixed(&config, &status, depth, blocks, None),
                alone,
                "{case}, n-gram"
            );
        }
    }

    #[test]
    fn a_verified_draft_stops_at_eos_and_never_passes_max_tokens() {
        let config = PipelineConfig {
            speculative: SpeculativeConfig::new(crate::speculative::DraftMethod::Ngram, 4),
            ..pipeline_config(4, vec![13])
        };
        let status = PipelineStatus::default();
        let mut sched = Scheduler::new(&config, &status, 2, 32);
        sched.set_drafter(Box::new(Oracle));
        let mut out = Outbox::default();
        let mut queue = vec![request(1, (1..=5).collect(), 100), request(2, vec![1, 2, 3], 6)];
        let mut no_drafts = request(3, vec![1, 2], 5);
        no_drafts.req.params.speculative_tokens = Some(0);
        let mut logprobs = request(4, vec![1, 2, 3, 4], 5);
        logprobs.req.logprobs = true;
        queue.extend([no_drafts, logprobs]);
        queue.reverse();
        sched.admit(|| queue.pop(), &mut out);
        let mut sent = VecDeque::new();
        let mut events = Vec::new();
        let mut drafted_with_logprobs = false;
        for _ in 0..50 {
            sched.schedule(&mut out);
            for b in out.batches.drain(..) {
                for c in &b.seqs {
                    if c.seq_id == 2 {
                        assert!(c.pos0 as usize + c.tokens.len() < 3 + 6, "past max_tokens");
                    }
                    if c.seq_id == 3 {
                        assert_eq!(c.draft, 0, "sequence 3 asked for no drafts");
                    }
                    drafted_with_logprobs |= c.seq_id == 4 && c.draft > 0;
                }
                sent.push_back(b);
            }
            let Some(batch) = sent.pop_front() else { break };
            sched.on_result(answer(&batch, |_, pos| pos), &mut out).unwrap();
            events.append(&mut out.events);
        }
        assert!(sched.is_idle());
        assert_eq!(tokens_of(&events, 1), (5..=13).collect::<Vec<_>>(), "stops at EOS 13");
        assert_eq!(tokens_of(&events, 2), (3..=8).collect::<Vec<_>>());
        assert_eq!(tokens_of(&events, 3), (2..=6).collect::<Vec<_>>());
        assert_eq!(tokens_of(&events, 4), (4..=8).collect::<Vec<_>>());
        // Logprobs come with every token, the verified draft's later ones included.
        assert!(drafted_with_logprobs);
        let logprobs: Vec<f32> = events
            .iter()
            .filter_map(|(id, e)| match e {
                TokenEvent::Token { logprobs, .. } if *id == 4 => Some(logprobs.as_ref().expect("asked for").logprob),
                _ => None,
            })
            .collect();
        assert_eq!(logprobs.len(), 5);
        assert!(
            logprobs.iter().skip(1).any(|&l| l < -1.0),
            "a drafted token's own logprob: {logprobs:?}"
        );
        let done = |id| {
            events
                .iter()
                .rev()
                .find(|(i, e)| *i == id && matches!(e, TokenEvent::Done { .. }))
                .cloned()
        };
        assert_eq!(
            done(1).map(|e| e.1),
            Some(TokenEvent::Done {
                reason: FinishReason::Stop
            })
        );
        assert_eq!(
            done(2).map(|e| e.1),
            Some(TokenEvent::Done {
                reason: FinishReason::Length
            })
        );
        assert!(status.spec_accepted_tokens.load(Ordering::Relaxed) >= 8);
    }

    #[test]
    fn an_answer_that_does_not_continue_the_draft_fails_only_its_sequence() {
        assert!(continues_draft(&[5, 6, 7], 5, &[6, 9]));
        assert!(continues_draft(&[5, 6, 7], 5, &[6, 7, 8]));
        assert!(continues_draft(&[5, 6, 7], 4, &[]));
        assert!(continues_draft(&[], 4, &[]));
        assert!(
            !continues_draft(&[5, 6, 7], 4, &[6]),
            "the first token rejected the draft"
        );
        assert!(
            !continues_draft(&[5, 6, 7], 5, &[7, 7]),
            "a rejected proposal cannot be followed"
        );
        assert!(!continues_draft(&[5], 5, &[6, 7]), "more tokens than proposals");
        assert!(!continues_draft(&[], 4, &[5]));

        let config = PipelineConfig {
            speculative: SpeculativeConfig::new(crate::speculative::DraftMethod::Ngram, 2),
            ..pipeline_config(4, vec![])
        };
        let status = PipelineStatus::default();
        let mut sched = Scheduler::new(&config, &status, 1, 32);
        sched.set_drafter(Box::new(Oracle));
        let mut out = Outbox::default();
        let mut queue = vec![request(2, vec![1, 2], 10), request(1, vec![1, 2], 10)];
        sched.admit(|| queue.pop(), &mut out);
        sched.schedule(&mut out);
        let first = out.batches.pop().unwrap();
        sched.on_result(answer(&first, |_, pos| pos), &mut out).unwrap();
        sched.schedule(&mut out);
        let verify = out.batches.pop().unwrap();
        assert!(verify.seqs.iter().all(|c| c.draft == 2));
        let mut reply = answer(&verify, |_, pos| pos);
        // Sequence 1's stage claims a token its draft did not propose, then one more.
        reply.results[0].more_tokens = vec![40, 41];
        out.events.clear();
        sched.on_result(reply, &mut out).unwrap();
        assert!(matches!(
            out.events.iter().find(|(id, _)| *id == 1),
            Some((_, TokenEvent::Failed { .. }))
        ));
        assert_eq!(tokens_of(&out.events, 2), [3, 4, 5]);
    }
}
