//! Where a stage keeps keys and values: behind [`BatchKv`], the forward pass writes a batch's
//! new K/V rows and attends over each sequence's cache without knowing the layout.
//!
//! * [`contiguous`]: one growable buffer per sequence (single-process engine).
//! * [`paged`]: a fixed pool of blocks shared by all sequences, addressed through block tables
//!   the coordinator allocates (pipeline stages).

pub mod contiguous;
pub mod paged;

pub use contiguous::{BatchSeq, SequenceKv};
pub use paged::{PagedBatch, PagedKv, PagedSeq, StateLayout};

use crate::kernels::cpu::attention::{KvData, Rows};
use crate::model::ForwardError;

/// How a KV cache stores keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    /// Exact: attention reads what the layer computed.
    #[default]
    F32,
    /// IEEE half: half the memory per position (so twice the sequences or context in the same
    /// budget), rounded to 11 significant bits when stored.
    F16,
}

impl KvDtype {
    /// Bytes per stored value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        })
    }
}

/// A KV dtype name that is not one.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown KV cache dtype '{0}' (expected f32 or f16)")]
pub struct UnknownKvDtype(String);

impl std::str::FromStr for KvDtype {
    type Err = UnknownKvDtype;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(KvDtype::F32),
            "f16" | "fp16" | "float16" | "half" => Ok(KvDtype::F16),
            _ => Err(UnknownKvDtype(s.to_string())),
        }
    }
}

/// Where each sequence of one batched forward pass stands: host metadata every device needs,
/// whatever memory its K/V live in. Sequence `i` contributes rows `pos0..pos0+len` (its
/// [`span`](Self::span)), in order, back to back.
pub trait KvSpans {
    /// Sequences in the batch.
    fn seqs(&self) -> usize;
    /// `(pos0, len)` of sequence `i`.
    fn span(&self, i: usize) -> (usize, usize);
    /// Positions sequence `i` holds before this batch (must equal its `pos0`).
    fn stored(&self, i: usize) -> usize;
    /// Sequence `i`'s prompt length: linear-attention layers run the delta rule's chunked
    /// form over the whole windows of [`DELTA_RULE_WINDOW`] positions (aligned to position 0)
    /// of its rows that lie below it, and token by token elsewhere (0: token by token).
    ///
    /// [`DELTA_RULE_WINDOW`]: baton_shared::model_config::DELTA_RULE_WINDOW
    fn prompt_len(&self, _i: usize) -> usize {
        0
    }
    /// Make room for every sequence's new rows, or say why there is none. Called once, before
    /// anything is written; an error leaves every cache unchanged.
    fn prepare(&mut self) -> Result<(), ForwardError>;
    /// Record the new rows as stored (after every layer succeeded).
    fn commit(&mut self);
}

/// A batch's K/V in host memory, as the CPU operations read and write them.
pub trait BatchKv: KvSpans + Sync {
    /// Store sequence `i`'s new rows of `layer` (`len × kv_dim` each).
    fn write(&mut self, i: usize, layer: usize, k: &[f32], v: &[f32]);
    /// Sequence `i`'s keys and values of `layer` and how positions map to their rows.
    fn layer(&self, i: usize, layer: usize) -> (KvData<'_>, KvData<'_>, Rows<'_>);
    /// Sequence `i`'s recurrent state in state slot `layer` (zeros when its first chunk
    /// starts at position 0), updated in place by a linear-attention layer.
    fn state(&mut self, i: usize, layer: usize) -> &mut [f32];
}

/// The positions of `pos0..pos0+len` (a sequence with prompt length `prompt_len`) that lie in
/// whole delta-rule windows below the prompt's end, so take the chunked form (see
/// [`KvSpans::prompt_len`]): whole windows back to back, or an empty range at the span's end.
pub fn delta_windows(pos0: usize, len: usize, prompt_len: usize) -> std::ops::Range<usize> {
    let window = baton_shared::model_config::DELTA_RULE_WINDOW;
    let first = pos0.div_ceil(window) * window;
    let end = (pos0 + len).min(prompt_len) / window * window;
    match end > first {
        true => first..end,
        false => pos0 + len..pos0 + len,
    }
}

/// Any [`BatchKv`] (a slice of contiguous sequences included) as a sized value, so it can be
/// passed where a `dyn BatchKv` is expected.
pub struct AnyKv<'k, K: ?Sized>(pub &'k mut K);

impl<K: BatchKv + ?Sized> KvSpans for AnyKv<'_, K> {
    fn seqs(&self) -> usize {
        self.0.seqs()
    }
    fn span(&self, i: usize) -> (usize, usize) {
        self.0.span(i)
    }
    fn stored(&self, i: usize) -> usize {
        self.0.stored(i)
    }
    fn prompt_len(&self, i: usize) -> usize {
        self.0.prompt_len(i)
    }
    fn prepare(&mut self) -> Result<(), ForwardError> {
        self.0.prepare()
    }
    fn commit(&mut self) {
        self.0.commit()
    }
}

impl<K: BatchKv + ?Sized> BatchKv for AnyKv<'_, K> {
    fn write(&mut self, i: usize, layer: usize, k: &[f32], v: &[f32]) {
        self.0.write(i, layer, k, v)
    }
    fn layer(&self, i: usize, layer: usize) -> (KvData<'_>, KvData<'_>, Rows<'_>) {
        self.0.layer(i, layer)
    }
    fn state(&mut self, i: usize, layer: usize) -> &mut [f32] {
        self.0.state(i, layer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_dtypes_parse_print_and_size() {
        for (s, d, bytes) in [
            ("f32", KvDtype::F32, 4),
            ("F16", KvDtype::F16, 2),
            ("fp16", KvDtype::F16, 2),
        ] {
            assert_eq!(s.parse::<KvDtype>(), Ok(d));
            assert_eq!(d.to_string().parse::<KvDtype>(), Ok(d));
            assert_eq!(d.bytes(), bytes);
        }
        let e = "bf16".parse::<KvDtype>().unwrap_err();
        assert_eq!(e.to_string(), "unknown KV cache dtype 'bf16' (expected f32 or f16)");
        assert_eq!(KvDtype::default(), KvDtype::F32);
    }

    #[test]
    fn delta_windows_are_the_whole_windows_of_a_span_below_the_prompts_end() {
        // (pos0, len, prompt_len) with 16-position windows.
        assert_eq!(delta_windows(0, 80, 80), 0..80);
        assert_eq!(delta_windows(0, 80, 70), 0..64, "the prompt's tail runs token by token");
        assert_eq!(delta_windows(0, 20, 80), 0..16, "a window cut by the chunk's end");
        assert_eq!(delta_windows(5, 43, 80), 16..48, "a window cut by the chunk's start");
        assert_eq!(delta_windows(70, 1, 0), 71..71, "a decode step");
        assert_eq!(delta_windows(3, 10, 100), 13..13);
    }
}
