//! Baton coordinator: the OpenAI-compatible HTTP API and the machinery that turns requests into
//! token streams (today a local engine; the gRPC pipeline driver attaches behind the same trait).

pub mod api;
pub mod cluster;
pub mod generation;
pub mod local;
pub mod pipeline;
pub mod planner;
pub mod registry;
