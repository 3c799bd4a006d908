//! Baton worker: holds a contiguous range of a model's layers and runs them.
//!
//! [`backend`] is what a [`stage`] computes on: it owns a layer range's model, its paged KV and
//! sampling. [`model`] holds one module per architecture (tensor names, layer layout) and the
//! blocks they are built from, written once against the device operations in [`ops`]; on the
//! CPU those run the runtime-dispatched kernels in [`kernels`] on a [`threads::ThreadPool`], with
//! weights in f32, bf16/f16, Q8_0, Q4_0 or Q4_1;
//! [`engine`] drives a whole model on one stage; [`roofline`] measures the memory bandwidth
//! that bounds batch-1 decode; [`profiler`] times a layer and the head for the split planner.

pub mod backend;
pub mod device_check;
pub mod drafting;
pub mod engine;
pub mod kernels;
pub mod kv_cache;
pub mod model;
pub mod ops;
pub mod profiler;
pub mod registration;
pub mod roofline;
pub mod run;
pub mod sampler;
pub mod service;
pub mod stage;
pub mod threads;
