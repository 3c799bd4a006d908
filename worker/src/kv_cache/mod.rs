//! Where a stage keeps keys and values: behind [`BatchKv`], the forward pass writes a batch's
//! new K/V rows and attends over each sequence's cache without knowing the layout.
//!
//! * [`contiguous`]: one growable buffer per sequence (single-process engine).
//! * [`paged`]: a fixed pool of blocks shared by all sequences, addressed through block tables
//!   the coordinator allocates (pipeline stages).

pub mod contiguous;
pub mod paged;

pub use contiguous::{BatchSeq, SequenceKv};
pub use paged::{PagedBatch, PagedKv, PagedSeq};

use crate::kernels::cpu::attention::Rows;
use crate::model::ForwardError;

/// The K/V of the sequences in one batched forward pass. Sequence `i` contributes rows
/// `pos0..pos0+len` (its [`span`](Self::span)), in order, back to back.
pub trait BatchKv: Sync {
    /// Sequences in the batch.
    fn seqs(&self) -> usize;
    /// `(pos0, len)` of sequence `i`.
    fn span(&self, i: usize) -> (usize, usize);
    /// Positions sequence `i` holds before this batch (must equal its `pos0`).
    fn stored(&self, i: usize) -> usize;
    /// Make room for every sequence's new rows, or say why there is none. Called once, before
    /// anything is written; an error leaves every cache unchanged.
    fn prepare(&mut self) -> Result<(), ForwardError>;
    /// Store sequence `i`'s new rows of `layer` (`len × kv_dim` each).
    fn write(&mut self, i: usize, layer: usize, k: &[f32], v: &[f32]);
    /// Sequence `i`'s keys and values of `layer` and how positions map to their rows.
    fn layer(&self, i: usize, layer: usize) -> (&[f32], &[f32], Rows<'_>);
    /// Record the new rows as stored (after every layer succeeded).
    fn commit(&mut self);
}
