//! Baton coordinator: the OpenAI-compatible HTTP API and the machinery that turns requests into
//! token streams: one step loop (`pipeline`) over an executor (`executor`) that runs
//! micro-batches on gRPC workers or on a stage in this process.

pub mod api;
pub mod cluster;
mod executor;
pub mod generation;
pub mod local;
pub mod pipeline;
pub mod planner;
pub mod registry;
