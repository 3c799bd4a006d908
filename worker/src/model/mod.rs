//! Models: a module per architecture ([`arch`], found through [`registry`]) that names its
//! tensors and lays out its layers from shared [`blocks`]; [`StageModel`] holds a stage's part
//! of any of them on any device ([`crate::ops::Ops`]) and runs the forward pass.

pub mod arch;
pub mod blocks;
pub mod dflash;
mod error;
mod format_choice;
mod loader;
mod on_cpu;
pub mod registry;
mod rope;
mod scratch;
pub mod spec;
mod stage_model;

pub use error::ForwardError;
pub use format_choice::{AUTO, auto_format, resolve_format};
pub use loader::WeightLoader;
pub use on_cpu::{LoadOptions, StageWeights};
pub use rope::Rope;
pub use scratch::{Batch, MoeStats, Scratch};
pub use stage_model::{PartBytes, StageModel};

pub use crate::kernels::cpu::matmul::WeightFormat;
