//! Decoder-only transformer (Llama / Qwen2 / Qwen3): weights for a contiguous layer range (the
//! linear layers and head in a chosen [`WeightFormat`]), and the forward pass over that range.

mod format_choice;
mod forward;
mod rope;
mod weights;

pub use format_choice::{AUTO, auto_format, resolve_format};
pub use forward::{ForwardError, Scratch};
pub use rope::Rope;
pub use weights::{LayerWeights, LoadOptions, PartBytes, StageWeights};

pub use crate::kernels::cpu::matmul::WeightFormat;
