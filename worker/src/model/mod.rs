//! Decoder-only transformer (Llama / Qwen2 / Qwen3) in fp32: weights for a contiguous layer
//! range, and the forward pass over that range.

mod forward;
mod rope;
mod weights;

pub use forward::{ForwardError, Scratch};
pub use rope::Rope;
pub use weights::{LayerWeights, StageWeights};
