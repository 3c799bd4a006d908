//! Baton worker: holds a contiguous range of a model's layers and runs them.
//!
//! Today this is the fp32 reference path: [`model`] loads a stage's weights and runs
//! "layers [a, b) on these hidden states", [`engine`] drives a whole model on one stage.

pub mod engine;
pub mod kernels;
pub mod kv_cache;
pub mod model;
pub mod registration;
pub mod run;
pub mod sampler;
pub mod service;
pub mod stage;
