//! Why a forward pass refused its input (bad input is an error, never a panic).

/// Errors from a forward pass.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ForwardError {
    #[error("token id {id} is out of range (vocabulary has {vocab} entries)")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("GPU: {0}")]
    Device(String),
    #[error("empty input: at least one token is needed")]
    Empty,
    #[error("sequence of {needed} tokens exceeds the model context of {max}")]
    ContextOverflow { needed: usize, max: usize },
    #[error("this stage does not hold the {0}")]
    MissingPart(&'static str),
    #[error("hidden states have {got} values, expected a multiple of {hidden}")]
    HiddenShape { got: usize, hidden: usize },
    #[error("KV cache holds {have} positions but the batch starts at position {pos0}")]
    KvPosition { have: usize, pos0: usize },
    #[error("{positions} positions need {needed} KV blocks but the block table has {have}")]
    KvBlocks {
        positions: usize,
        needed: usize,
        have: usize,
    },
    #[error("KV block id {id} is outside the pool of {blocks} blocks")]
    KvBlockId { id: u32, blocks: usize },
    #[error("recurrent-state slot {slot} is outside the stage's {slots} slots")]
    StateSlot { slot: usize, slots: usize },
    #[error("recurrent-state snapshot {snapshot} is outside the stage's {snapshots} snapshots")]
    StateSnapshot { snapshot: usize, snapshots: usize },
    #[error("a saved recurrent state of {got} values does not fit a slot of {want}")]
    StateSize { got: usize, want: usize },
}
