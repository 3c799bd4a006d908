//! Resolving a `--model` argument (a GGUF file, a Hugging Face directory or a known short name)
//! and opening everything a model needs: files, config and tokenizer.

use std::path::{Path, PathBuf};

use crate::fetch::{self, FetchError, Sources};
use crate::model_config::ModelConfig;
use crate::model_files::{LoadError, ModelFiles};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Errors resolving or opening a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelSourceError {
    #[error("model '{0}' not found: not a .gguf file, a Hugging Face directory, or a known name (known: smollm2-135m)")]
    NotFound(String),
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Turn a `--model` value into a path, fetching the default model when asked for by name or
/// when no model is given.
pub fn resolve_model(
    arg: Option<&str>,
    home: &Path,
    sources: &Sources,
    progress: bool,
) -> Result<PathBuf, ModelSourceError> {
    match arg {
        None => Ok(fetch::ensure_default_model(home, sources, progress)?),
        Some(name) if name.eq_ignore_ascii_case(fetch::DEFAULT_MODEL) || name == fetch::HF_REPO => {
            Ok(fetch::ensure_default_model(home, sources, progress)?)
        }
        Some(p) => {
            let path = PathBuf::from(p);
            if path.exists() {
                Ok(path)
            } else {
                Err(ModelSourceError::NotFound(p.into()))
            }
        }
    }
}

/// A model opened from disk: memory-mapped files, config and tokenizer.
#[derive(Debug)]
pub struct LoadedModel {
    pub files: ModelFiles,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
}

impl LoadedModel {
    /// Open a GGUF file or Hugging Face directory.
    pub fn open(path: &Path) -> Result<Self, ModelSourceError> {
        let files = ModelFiles::open(path)?;
        let config = files.config()?;
        let tokenizer = match &files {
            ModelFiles::Gguf(g) => Tokenizer::from_gguf(g)?,
            ModelFiles::HfDir { dir, .. } => Tokenizer::from_hf_dir(dir)?,
        };
        Ok(Self {
            files,
            config,
            tokenizer,
        })
    }
}
