//! Speculative decoding, the coordinator's half: a drafter proposes the next few tokens of a
//! decoding sequence, the scheduler sends them with its last token as one chunk, and the last
//! stage verifies them (`baton_worker::backend::sample_rows`), answering with the accepted
//! proposals and one token of its own. Every stage keeps the chunk's K/V; the sequence's next
//! chunk starts after the accepted tokens, and each stage drops the rejected positions then.
//!
//! Drafters sit behind [`Drafter`]; [`Adaptive`] decides per sequence how many tokens to ask
//! for, backing off when proposals keep being rejected so a stream that does not repeat
//! itself decodes as it would without speculation.

pub mod ngram;

use std::fmt;
use std::sync::Arc;

pub use baton_shared::sampling::MAX_SPECULATIVE_TOKENS;

/// Which drafter proposes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DraftMethod {
    /// No speculation: one token per decode step.
    #[default]
    Off,
    /// Prompt lookup: continue the latest earlier occurrence of the last few tokens.
    Ngram,
    /// A DFlash block-diffusion draft on the last stage, conditioned on taps of target layers.
    Dflash,
}

impl DraftMethod {
    /// The name in settings, metrics and traces.
    pub fn as_str(self) -> &'static str {
        match self {
            DraftMethod::Off => "off",
            DraftMethod::Ngram => "ngram",
            DraftMethod::Dflash => "dflash",
        }
    }
}

impl fmt::Display for DraftMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Makes the drafter of each pipeline built (a program embedding Baton, or a test, may bring
/// its own).
pub type DrafterFactory = Arc<dyn Fn() -> Box<dyn Drafter> + Send + Sync>;

/// A server's speculative decoding settings.
#[derive(Clone, Default)]
pub struct SpeculativeConfig {
    pub method: DraftMethod,
    /// Proposals per verify step at most (k); a request may ask for fewer or none.
    pub tokens: usize,
    /// A drafter of the caller's own instead of `method`'s (`method` must not be `Off`).
    pub custom: Option<DrafterFactory>,
    /// The DFlash draft checkpoint directory, as the workers resolve it (`Dflash` only).
    pub draft_model: Option<String>,
}

impl fmt::Debug for SpeculativeConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpeculativeConfig")
            .field("method", &self.method)
            .field("tokens", &self.tokens)
            .field("custom", &self.custom.is_some())
            .field("draft_model", &self.draft_model)
            .finish()
    }
}

impl SpeculativeConfig {
    /// No speculation.
    pub const OFF: Self = Self {
        method: DraftMethod::Off,
        tokens: 0,
        custom: None,
        draft_model: None,
    };

    /// `method` proposing up to `tokens` per verify step.
    pub fn new(method: DraftMethod, tokens: usize) -> Self {
        Self {
            method,
            tokens,
            custom: None,
            draft_model: None,
        }
    }

    /// DFlash with the draft at `draft_model` (a directory the workers can read).
    pub fn dflash(draft_model: impl Into<String>, tokens: usize) -> Self {
        Self {
            draft_model: Some(draft_model.into()),
            ..Self::new(DraftMethod::Dflash, tokens)
        }
    }

    /// The draft the workers load (DFlash only).
    pub fn worker_draft(&self) -> Option<&str> {
        match self.method {
            DraftMethod::Dflash => self.draft_model.as_deref(),
            _ => None,
        }
    }

    /// Proposals to ask for a request that asked for `requested` (None: the server's k).
    pub fn tokens_for(&self, requested: Option<usize>) -> usize {
        match self.method {
            DraftMethod::Off => 0,
            _ => requested.unwrap_or(self.tokens).min(MAX_SPECULATIVE_TOKENS),
        }
    }
}

/// Proposes tokens to follow a sequence.
pub trait Drafter: Send {
    /// The method, for metrics.
    fn method(&self) -> DraftMethod;
    /// Append up to `k` proposed tokens to follow `tokens` (prompt and output so far).
    fn propose(&mut self, tokens: &[u32], k: usize, out: &mut Vec<u32>);
    /// Whether the last stage drafts (DFlash): a sequence's chunks then carry taps and ask for
    /// proposals, and its next step verifies what came back instead of asking `propose`.
    fn on_last_stage(&self) -> bool {
        false
    }
}

/// DFlash: the last stage drafts right after each verify step (`baton_worker::drafting`), so
/// the proposals come back with the tokens; there is nothing to propose here.
#[derive(Debug, Default)]
pub struct DflashDrafter;

impl Drafter for DflashDrafter {
    fn method(&self) -> DraftMethod {
        DraftMethod::Dflash
    }

    fn propose(&mut self, _tokens: &[u32], _k: usize, _out: &mut Vec<u32>) {}

    fn on_last_stage(&self) -> bool {
        true
    }
}

/// Prompt-lookup drafting ([`ngram::propose`]).
#[derive(Debug, Default)]
pub struct NgramDrafter;

impl Drafter for NgramDrafter {
    fn method(&self) -> DraftMethod {
        DraftMethod::Ngram
    }

    fn propose(&mut self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        ngram::propose(tokens, k, out);
    }
}

/// The drafter a configuration names; None when speculation is off.
pub fn drafter(config: &SpeculativeConfig) -> Option<Box<dyn Drafter>> {
    match (config.method, &config.custom) {
        (DraftMethod::Off, _) => None,
        (_, Some(make)) => Some(make()),
        (DraftMethod::Ngram, None) => Some(Box::new(NgramDrafter)),
        (DraftMethod::Dflash, None) => Some(Box::new(DflashDrafter)),
    }
}

/// Decode rows in a micro-batch beyond which it is compute-bound on a CPU: every proposal then
/// costs about what a sequence's own token does, so only sequences whose proposals are mostly
/// accepted keep drafting.
pub const LOADED_DECODE_ROWS: usize = 4;
/// Share of proposals a sequence must have had accepted lately to draft in a loaded batch.
const LOADED_MIN_ACCEPTANCE: f32 = 0.5;
/// Weight of the latest verify step in the acceptance average.
const ACCEPTANCE_WEIGHT: f32 = 0.25;
/// How far each step skipped under load moves that average back towards 1.
const RECOVERY_WEIGHT: f32 = 0.05;

/// Consecutive verify steps that accept nothing before a sequence pauses drafting.
const MISSES_BEFORE_PAUSE: u32 = 2;
/// Longest pause, in decode steps.
const MAX_PAUSE: u32 = 64;

/// One sequence's drafting pace: how many proposals to ask for next. It grows while whole
/// drafts are accepted, shrinks to what was accepted plus one after a partial acceptance, and
/// after repeated misses pauses drafting for a number of steps that doubles per further miss
/// (up to [`MAX_PAUSE`]), so a stream the drafter cannot predict costs almost nothing extra.
/// In a loaded micro-batch (more than [`LOADED_DECODE_ROWS`] decode rows) it drafts only while
/// at least half its recent proposals were accepted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adaptive {
    /// Proposals to ask for next, before the caller's limits.
    k: usize,
    misses: u32,
    /// Decode steps left without drafting.
    pause: u32,
    /// Recent share of proposals accepted (a moving average; 1 before the first verify).
    acceptance: f32,
}

impl Adaptive {
    /// A fresh sequence: ask for the full `k` at first.
    pub fn new(k: usize) -> Self {
        Self {
            k,
            misses: 0,
            pause: 0,
            acceptance: 1.0,
        }
    }

    /// Proposals to ask for this step (at most `max`) in a micro-batch of `decode_rows`
    /// decoding sequences; 0 while paused (and counts the step).
    pub fn next(&mut self, max: usize, decode_rows: usize) -> usize {
        if self.pause > 0 {
            self.pause -= 1;
            return 0;
        }
        if decode_rows > LOADED_DECODE_ROWS && self.acceptance < LOADED_MIN_ACCEPTANCE {
            // Skipped steps slowly restore confidence, so the sequence tries again later (its
            // text may have turned repetitive).
            self.acceptance += RECOVERY_WEIGHT * (1.0 - self.acceptance);
            return 0;
        }
        self.k.clamp(1, max.max(1)).min(max)
    }

    /// Whether the next step drafts nothing, whatever happens to this one (a pause is under
    /// way): a drafter on the last stage need not draft for it.
    pub fn pausing(&self) -> bool {
        self.pause > 0
    }

    /// A verify step proposed `proposed` tokens (at most `max`) and `accepted` were kept.
    pub fn observe(&mut self, proposed: usize, accepted: usize, max: usize) {
        if proposed == 0 {
            return;
        }
        let share = accepted as f32 / proposed as f32;
        self.acceptance += ACCEPTANCE_WEIGHT * (share - self.acceptance);
        if accepted == 0 {
            self.misses += 1;
            self.k = 1;
            if self.misses >= MISSES_BEFORE_PAUSE {
                self.pause = (1u32 << (self.misses - MISSES_BEFORE_PAUSE + 1).min(6)).min(MAX_PAUSE);
            }
        } else {
            self.misses = 0;
            self.k = if accepted == proposed {
                (proposed * 2).min(max.max(1))
            } else {
                accepted + 1
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adaptive_grows_on_full_acceptance_and_shrinks_on_partial() {
        let mut a = Adaptive::new(4);
        assert_eq!(a.next(8, 1), 4);
        a.observe(4, 4, 8);
        assert_eq!(a.next(8, 1), 8);
        a.observe(8, 2, 8);
        assert_eq!(a.next(8, 1), 3);
        // The caller's limit (tokens left, context) always wins.
        assert_eq!(a.next(2, 1), 2);
        assert_eq!(a.next(0, 1), 0);
    }

    #[test]
    fn adaptive_pauses_after_misses_for_longer_each_time() {
        let mut a = Adaptive::new(4);
        a.observe(4, 0, 4);
        assert_eq!(a.next(4, 1), 1, "one miss: keep trying with one proposal");
        a.observe(1, 0, 4);
        assert!(a.pausing());
        let pause = |a: &mut Adaptive| (0..100).take_while(|_| a.next(4, 1) == 0).count();
        assert_eq!(pause(&mut a), 2);
        assert!(!a.pausing());
        a.observe(1, 0, 4);
        assert_eq!(pause(&mut a), 4);
        a.observe(1, 0, 4);
        assert_eq!(pause(&mut a), 8);
        for _ in 0..10 {
            a.observe(1, 0, 4);
        }
        assert_eq!(pause(&mut a), MAX_PAUSE as usize);
        // One hit ends the pauses.
        a.observe(1, 1, 4);
        assert_eq!(a.next(4, 1), 2);
    }

    #[test]
    fn adaptive_drafts_in_a_loaded_batch_only_while_mostly_accepted() {
        let mut a = Adaptive::new(4);
        let loaded = LOADED_DECODE_ROWS + 1;
        assert_eq!(a.next(4, loaded), 4, "no verify yet: optimistic");
        // A quarter of each draft accepted: the average falls below one half.
        for _ in 0..8 {
            a.observe(4, 1, 4);
        }
        assert_eq!(
            a.next(4, loaded),
            0,
            "a quarter accepted lately: no drafting under load"
        );
        assert_eq!(a.next(4, 1), 2, "alone it still drafts");
        // Skipped loaded steps restore enough confidence to try again.
        let skipped = (0..100).take_while(|_| a.next(4, loaded) == 0).count();
        assert!((1..10).contains(&skipped), "{skipped}");
        for _ in 0..8 {
            a.observe(2, 2, 4);
        }
        assert!(a.next(4, loaded) > 0, "mostly accepted again");
    }

    #[test]
    fn requests_choose_within_the_server_limit() {
        let on = SpeculativeConfig::new(DraftMethod::Ngram, 4);
        assert_eq!(on.tokens_for(None), 4);
        assert_eq!(on.tokens_for(Some(0)), 0);
        assert_eq!(on.tokens_for(Some(7)), 7);
        assert_eq!(on.tokens_for(Some(1000)), MAX_SPECULATIVE_TOKENS);
        assert_eq!(SpeculativeConfig::OFF.tokens_for(Some(3)), 0);
    }
}
