//! Memory-mapped safetensors checkpoints: one `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Only headers are parsed at open; tensor bytes are read
//! (paged in) when a caller asks for them, so a stage touches only its own layers.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::Dtype as StDtype;

use crate::dtype::DType;

/// Errors opening a safetensors checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    #[error("{path}: cannot open: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: invalid safetensors file: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{path}: invalid shard index: {message}")]
    Index { path: PathBuf, message: String },
    #[error("{path}: tensor '{tensor}' has dtype {dtype}, which Baton does not load (F32, F16, BF16 only)")]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("{dir}: no model.safetensors or model.safetensors.index.json")]
    NoWeights { dir: PathBuf },
}

/// Location of one tensor inside one of the mapped shard files.
#[derive(Debug, Clone)]
pub struct StTensorInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
    file: usize,
    start: usize,
    end: usize,
}

/// An opened safetensors checkpoint (single file or sharded).
pub struct SafetensorsDir {
    paths: Vec<PathBuf>,
    maps: Vec<Mmap>,
    pub tensors: BTreeMap<String, StTensorInfo>,
}

impl std::fmt::Debug for SafetensorsDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsDir")
            .field("paths", &self.paths)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl SafetensorsDir {
    /// Open the checkpoint in a Hugging Face model directory.
    pub fn open(dir: &Path) -> Result<Self, SafetensorsError> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            shard_files(&index)?
        } else {
            return Err(SafetensorsError::NoWeights { dir: dir.to_path_buf() });
        };
        let mut out = SafetensorsDir {
            paths: Vec::new(),
            maps: Vec::new(),
            tensors: BTreeMap::new(),
        };
        for path in files {
            out.add_file(path)?;
        }
        Ok(out)
    }

    fn add_file(&mut self, path: PathBuf) -> Result<(), SafetensorsError> {
        let invalid = |message: String| SafetensorsError::Invalid {
            path: path.clone(),
            message,
        };
        let file = File::open(&path).map_err(|source| SafetensorsError::Io {
            path: path.clone(),
            source,
        })?;
        // SAFETY: read-only mapping of a model file that is not modified while in use.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| SafetensorsError::Io {
            path: path.clone(),
            source,
        })?;
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map).map_err(|e| invalid(e.to_string()))?;
        let data_start = 8 + header_len;
        let file_idx = self.maps.len();
        for (name, info) in meta.tensors() {
            let dtype = match info.dtype {
                StDtype::F32 => DType::F32,
                StDtype::F16 => DType::F16,
                StDtype::BF16 => DType::BF16,
                other => {
                    return Err(SafetensorsError::UnsupportedDtype {
                        path: path.clone(),
                        tensor: name,
                        dtype: format!("{other:?}"),
                    });
                }
            };
            let (begin, end) = info.data_offsets;
            let n: usize = info.shape.iter().product();
            if end < begin || end - begin != dtype.n_bytes(n) || data_start + end > map.len() {
                return Err(invalid(format!(
                    "tensor '{name}' data offsets {begin}..{end} do not fit shape {:?}",
                    info.shape
                )));
            }
            let entry = StTensorInfo {
                dtype,
                shape: info.shape.clone(),
                file: file_idx,
                start: data_start + begin,
                end: data_start + end,
            };
            if self.tensors.insert(name.clone(), entry).is_some() {
                return Err(invalid(format!("tensor '{name}' is stored in more than one shard")));
            }
        }
        self.paths.push(path);
        self.maps.push(map);
        Ok(())
    }

    /// Raw little-endian bytes of a tensor.
    pub fn tensor_data(&self, info: &StTensorInfo) -> &[u8] {
        &self.maps[info.file][info.start..info.end]
    }

    /// The file a tensor lives in.
    pub fn tensor_path(&self, info: &StTensorInfo) -> &Path {
        &self.paths[info.file]
    }
}

fn shard_files(index: &Path) -> Result<Vec<PathBuf>, SafetensorsError> {
    let err = |message: String| SafetensorsError::Index {
        path: index.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(index).map_err(|source| SafetensorsError::Io {
        path: index.to_path_buf(),
        source,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(format!("invalid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| err("missing 'weight_map' object".into()))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for (tensor, file) in map {
        let name = file
            .as_str()
            .ok_or_else(|| err(format!("weight_map['{tensor}'] is not a file name")))?;
        // Shard names are plain file names; refuse anything that would leave the directory.
        if name.contains('/') || name.contains('\\') || name.starts_with('.') {
            return Err(err(format!("shard name '{name}' is not a plain file name")));
        }
        let p = dir.join(name);
        if !files.contains(&p) {
            files.push(p);
        }
    }
    if files.is_empty() {
        return Err(err("weight_map is empty".into()));
    }
    files.sort();
    Ok(files)
}
