//! Baton coordinator: the OpenAI-compatible HTTP API and the machinery that turns requests into
//! token streams: a pure `scheduler`, one `engine` loop that carries out its decisions on an
//! `executor` (gRPC workers or a stage in this process), and the `pipeline` that builds and
//! supervises it.

pub mod api;
pub mod cluster;
mod engine;
mod executor;
pub mod generation;
pub mod local;
pub mod pipeline;
pub mod planner;
pub mod registry;
mod scheduler;
pub mod speculative;
