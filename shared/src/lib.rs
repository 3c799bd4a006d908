//! Code shared by every Baton process: model configuration, weight files (safetensors, GGUF),
//! tokenizer and chat template, sampling parameters, and fetching the default model.

pub mod chat_template;
pub mod dtype;
pub mod fetch;
pub mod gguf;
pub mod model_config;
pub mod model_files;
pub mod model_source;
pub mod safetensors_dir;
pub mod sampling;
pub mod settings;
pub mod tokenizer;
