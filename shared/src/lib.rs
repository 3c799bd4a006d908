//! Code shared by every Baton process: model configuration, weight files (safetensors, GGUF),
//! tokenizer and chat template, sampling parameters, and fetching the default model.

pub mod auth;
pub mod chat_template;
pub mod dtype;
pub mod fetch;
pub mod gguf;
pub mod grpc_limits;
pub mod logging;
pub mod model_config;
pub mod model_files;
pub mod model_source;
pub mod safetensors_dir;
pub mod sampling;
pub mod settings;
pub mod skip_report;
pub mod stop;
pub mod telemetry;
pub mod tls;
pub mod tokenizer;
pub mod trace_context;
pub mod wire;

/// Generated gRPC types and services (`proto/baton/v1/baton.proto`).
pub mod proto {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("baton.v1");
}
