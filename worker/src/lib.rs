//! Baton worker: holds a contiguous range of a model's layers and runs them.
//!
//! [`model`] loads a stage's weights (f32 or Q8_0 linear layers) and runs "layers [a, b) on these
//! hidden states" with the runtime-dispatched kernels in [`kernels`] on a [`threads::ThreadPool`];
//! [`engine`] drives a whole model on one stage.

pub mod engine;
pub mod kernels;
pub mod kv_cache;
pub mod model;
pub mod registration;
pub mod run;
pub mod sampler;
pub mod service;
pub mod stage;
pub mod threads;
